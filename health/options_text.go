package health

import (
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy/internal/redact"
)

// String returns the options' plain values, as %+v would show them but
// without the zero ones: the password shows as REDACTED, credentials in
// EgressURL too, and TLS, Exchange, DialContext, ProxyTLS and EgressTLS
// only as set. Every fmt verb uses it (or
// GoString), so the password never reaches a log line or an error.
func (o ProbeOptions) String() string {
	var b fieldText
	if o.Timeout != 0 {
		b.raw("Timeout", o.Timeout.String())
	}
	b.str("Username", o.Username)
	b.secret("Password", o.Password != "")
	b.set("TLS", o.TLS != nil)
	b.set("Exchange", o.Exchange != nil)
	b.set("DialContext", o.DialContext != nil)
	b.set("ProxyTLS", o.ProxyTLS != nil)
	if o.EgressURL != "" {
		b.raw("EgressURL", quote(redact.URL(o.EgressURL)))
	}
	b.set("EgressTLS", o.EgressTLS != nil)
	return b.done()
}

// GoString is String for %#v.
func (o ProbeOptions) GoString() string { return "health.ProbeOptions" + o.String() }

// String returns the options' plain values without the password (see
// ProbeOptions.String); Logger and TracerProvider show only as set.
func (o ProbeAllOptions) String() string {
	var b fieldText
	if o.Workers != 0 {
		b.raw("Workers", strconv.Itoa(o.Workers))
	}
	b.str("Target", o.Target)
	if p := o.Probe.String(); p != "{}" {
		b.raw("Probe", p)
	}
	b.set("Logger", o.Logger.GetSink() != nil)
	b.set("TracerProvider", o.TracerProvider != nil)
	return b.done()
}

// GoString is String for %#v.
func (o ProbeAllOptions) GoString() string { return "health.ProbeAllOptions" + o.String() }

// String returns the proxy's fields without its password (see
// ProbeOptions.String).
func (p Proxy) String() string {
	var b fieldText
	b.str("ID", p.ID)
	b.str("Address", p.Address)
	b.str("Target", p.Target)
	b.str("Username", p.Username)
	b.secret("Password", p.Password != "")
	b.set("ProxyTLS", p.ProxyTLS != nil)
	return b.done()
}

// GoString is String for %#v.
func (p Proxy) GoString() string { return "health.Proxy" + p.String() }

// fieldText builds "{Name:value Name:value}" from the non-zero fields.
type fieldText struct{ b strings.Builder }

func (t *fieldText) raw(name, value string) {
	if t.b.Len() > 0 {
		t.b.WriteByte(' ')
	}
	t.b.WriteString(name)
	t.b.WriteByte(':')
	t.b.WriteString(value)
}

func (t *fieldText) str(name, v string) {
	if v != "" {
		t.raw(name, quote(v))
	}
}

func (t *fieldText) secret(name string, set bool) {
	if set {
		t.raw(name, "REDACTED")
	}
}

func (t *fieldText) set(name string, set bool) {
	if set {
		t.raw(name, "set")
	}
}

func (t *fieldText) done() string { return "{" + t.b.String() + "}" }
