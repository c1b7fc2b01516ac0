package obs

import (
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// The instrument names of the module, one constant each: names are never
// built from input. docs/observability.md documents every one (unit,
// attributes, when it changes); Instruments lists them.
const (
	// MetricClientOperationDuration: histogram, s, one measurement per
	// Client operation.
	MetricClientOperationDuration = "egressproxy.client.operation.duration"
	// MetricEntryReachable: gauge, {entry}, the last Check's Reachable.
	MetricEntryReachable = "egressproxy.entry.reachable"
	// MetricEntryPoolAvailable: gauge, By, the last Check's pool space.
	MetricEntryPoolAvailable = "egressproxy.entry.pool.available"
	// MetricEntryMemoryAvailable: gauge, By, the last Check's host memory.
	MetricEntryMemoryAvailable = "egressproxy.entry.memory.available"
	// MetricEntryCPUCount: gauge, {cpu}, the last Check's host CPUs.
	MetricEntryCPUCount = "egressproxy.entry.cpu.count"
	// MetricEntryInstanceCount: gauge, {instance}, the last Check's
	// running instances of the owner.
	MetricEntryInstanceCount = "egressproxy.entry.instance.count"
	// MetricLibvirtRPCDuration: histogram, s, one measurement per libvirt
	// remote procedure call answered or lost.
	MetricLibvirtRPCDuration = "egressproxy.libvirt.rpc.duration"
	// MetricSSHConnectionState: gauge, {connection}, the state of a
	// pool's shared SSH connection.
	MetricSSHConnectionState = "egressproxy.ssh.connection.state"
	// MetricSSHRedials: counter, {dial}, dials of a pool's shared SSH
	// connection after its first.
	MetricSSHRedials = "egressproxy.ssh.redials"
	// MetricHealthProbeDuration: histogram, s, one measurement per probe
	// of ProbeAll or Tracker.Round.
	MetricHealthProbeDuration = "egressproxy.health.probe.duration"
	// MetricHealthProxyState: gauge, {proxy}, the state of each proxy a
	// Tracker tracks.
	MetricHealthProxyState = "egressproxy.health.proxy.state"
	// MetricImageTransferSize: counter, By, the bytes an entry's cold
	// fetches moved into its pool, by the source that fed them.
	MetricImageTransferSize = "egressproxy.image.transfer.size"
	// MetricImageFetchDuration: histogram, s, one measurement per cold
	// fetch of a base image.
	MetricImageFetchDuration = "egressproxy.image.fetch.duration"
	// MetricImageVerifyFailures: counter, {failure}, checks of an image's
	// bytes that found other bytes than expected.
	MetricImageVerifyFailures = "egressproxy.image.verify.failures"
	// MetricImageEvictions: counter, {base}, bases removed by Evict.
	MetricImageEvictions = "egressproxy.image.evictions"
	// MetricImageBaseCount: gauge, {base}, an entry's published bases.
	MetricImageBaseCount = "egressproxy.image.base.count"
	// MetricImageBaseUsage: gauge, By, the stored size of an entry's
	// published bases.
	MetricImageBaseUsage = "egressproxy.image.base.usage"
)

// Instruments returns the name of every instrument of the module.
func Instruments() []string {
	return []string{
		MetricClientOperationDuration,
		MetricEntryReachable, MetricEntryPoolAvailable, MetricEntryMemoryAvailable,
		MetricEntryCPUCount, MetricEntryInstanceCount,
		MetricLibvirtRPCDuration,
		MetricSSHConnectionState, MetricSSHRedials,
		MetricHealthProbeDuration, MetricHealthProxyState,
		MetricImageTransferSize, MetricImageFetchDuration, MetricImageVerifyFailures,
		MetricImageEvictions, MetricImageBaseCount, MetricImageBaseUsage,
	}
}

// The metric attribute keys beside KeyEntry and KeyErrorType. Every value
// comes from a fixed set (an operation, a procedure, a state, a kind),
// except KeyProxyID, which only the per-proxy health gauge carries.
const (
	// KeyOperation is the Client operation: "create", "get", ...
	KeyOperation = attribute.Key("egressproxy.operation")
	// KeyRPCMethod is the libvirt procedure, named as go-libvirt's method
	// ("DomainLookupByName"); "_OTHER" for one outside the remote
	// program's table.
	KeyRPCMethod = attribute.Key("rpc.method")
	// KeySSHState is a shared SSH connection's state: "idle",
	// "connected" or "disconnected".
	KeySSHState = attribute.Key("egressproxy.ssh.state")
	// KeyProbeKind is a probe's outcome, health.Kind's String: "none"
	// for a success, else the failure's kind ("refused", "timeout", ...).
	KeyProbeKind = attribute.Key("egressproxy.probe.kind")
	// KeyProxyID is a tracked proxy's ID (health.Proxy.ID), bounded like
	// every string attribute.
	KeyProxyID = attribute.Key("egressproxy.proxy.id")
	// KeyHealthState is a tracked proxy's state: "healthy", "unhealthy"
	// or "unknown".
	KeyHealthState = attribute.Key("egressproxy.health.state")
	// KeyImageSource is where an image cache's bytes came from: "mirror",
	// "shared", "peer", "detached", or "switched" for a fetch fed by
	// several sources in turn.
	KeyImageSource = attribute.Key("egressproxy.image.source")
	// KeyImageCheck is the check of an image's bytes that failed:
	// "digest", "stored" or "marker".
	KeyImageCheck = attribute.Key("egressproxy.image.check")
)

// The units, in UCUM as the semantic conventions write them. A gauge of
// states counts what is in each state ("{proxy}", "{connection}"), as the
// semantic conventions' connection counts do, rather than using "1", which
// Prometheus exporters turn into a "_ratio" suffix.
const (
	UnitSeconds = "s"
	UnitBytes   = "By"
)

// Meter returns the meter of scope name from mp; a nil mp gives a no-op
// meter.
func Meter(mp metric.MeterProvider, name string) metric.Meter {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	return mp.Meter(name)
}

// DurationBuckets returns the bucket boundaries, in seconds, of every
// duration histogram of the module: from half a millisecond (a libvirt
// call on a near host, a probe on loopback) to twenty minutes (a cold
// image fetch inside Create).
func DurationBuckets() []float64 {
	return []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1200}
}

// DurationHistogram creates the histogram name (seconds, DurationBuckets)
// on m. The name is one of this package's constants, which every SDK
// accepts; an SDK that refuses it anyway returns a working instrument with
// the error, which is dropped here.
func DurationHistogram(m metric.Meter, name, desc string) metric.Float64Histogram {
	h, _ := m.Float64Histogram(name, metric.WithUnit(UnitSeconds), metric.WithDescription(desc),
		metric.WithExplicitBucketBoundaries(DurationBuckets()...))
	return h
}

// Int64Gauge creates the observable gauge name with unit on m (see
// DurationHistogram for the error).
func Int64Gauge(m metric.Meter, name, unit, desc string) metric.Int64ObservableGauge {
	g, _ := m.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
	return g
}

// ErrorTypeAttr appends the error.type attribute of err to kvs when err is
// not nil (see ErrorType).
func ErrorTypeAttr(kvs []attribute.KeyValue, err error) []attribute.KeyValue {
	if err == nil {
		return kvs
	}
	return append(kvs, KeyErrorType.String(ErrorType(err)))
}
