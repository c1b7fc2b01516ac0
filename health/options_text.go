package health

import "encoding/json"

// String returns the options as their JSON form (camelCase, durations as
// strings): the plain values only. Password, TLS, Exchange and Dialer are
// never marshalled, so the proxy password cannot reach a log line or an
// error through fmt (%v, %+v, %s).
func (o ProbeOptions) String() string { return optionsText(o) }

// GoString is String for %#v.
func (o ProbeOptions) GoString() string { return "health.ProbeOptions" + o.String() }

// String returns the options as their JSON form, without the password of
// Probe or the collaborators (see ProbeOptions.String).
func (o ProbeAllOptions) String() string { return optionsText(o) }

// GoString is String for %#v.
func (o ProbeAllOptions) GoString() string { return "health.ProbeAllOptions" + o.String() }

// optionsText marshals v; the option structs always marshal (their
// unmarshallable fields are tagged "-"), so the error text is a fallback
// that shows no field value.
func optionsText(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return "{<unprintable options>}"
	}
	return string(b)
}
