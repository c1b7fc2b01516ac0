// Package obs holds the span and metric convention every package of this
// module follows: stable span and instrument names, the egressproxy.*
// attributes, and how a span ends on failure. docs/observability.md lists
// every span name, instrument and attribute; this package is the one place
// that writes them.
//
// The convention, after the OpenTelemetry semantic conventions:
//
//   - A span is named after the operation, "<package>.<Operation>"
//     (egressproxy.Create, kvm2.Get, imagecache.Fetch, health.Round);
//     names are constants, never built from input.
//   - The attributes egressproxy.entry, egressproxy.instance and
//     egressproxy.volume are set where the operation knows them and are
//     never empty: an empty value is left out. Every string attribute
//     value is valid UTF-8 and at most MaxAttrLen bytes, whatever the
//     input.
//   - On failure the span gets error.type (the error's class,
//     errs.Code(err).String(): "NotFound", "Permanent", "Transient",
//     "Canceled", "DeadlineExceeded"; "_OTHER" for an unclassed error),
//     status Error with a bounded description, and the error recorded as
//     an exception event. On success none of these is set and the status
//     stays Unset.
//   - Error text reaches a span only as the package's own errors, which
//     carry no secret (imagecache redacts URLs before they get here).
//   - Instruments are named "egressproxy.<area>.<what>" in units of UCUM
//     (s, By, 1, {thing}); the names are the Metric constants. Every
//     attribute value comes from a fixed set (an operation, a class, a
//     state, a kind, a configured entry), so label sets stay bounded: no
//     instance name on any instrument, and a proxy's ID only on the
//     per-proxy health gauge, whose series end when the proxy is
//     forgotten. Durations are seconds in one set of buckets
//     (DurationBuckets). A nil MeterProvider is a no-op.
package obs
