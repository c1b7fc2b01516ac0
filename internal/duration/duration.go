package duration

import (
	"github.com/egressproxy/egressproxy/internal/errs"

	"encoding/json"
	"reflect"
	"time"
)

// Duration is a time.Duration as a configuration file writes it: a string
// in time.ParseDuration syntax ("30s", "2m", "1h30m", "500ms", "0s"). The
// Config types that marshal (kvm2.Config, sshconn.Config) hold
// time.Duration fields and marshal them through it, so a JSON or YAML file
// never gives a duration in nanoseconds.
//
// It marshals to that string (Duration(90*time.Second) is "1m30s"). It
// unmarshals from a string only: a bare number is refused with an error
// that names the field, because 30 would mean 30 nanoseconds. null leaves
// the value unchanged, as encoding/json does for other types.
//
// In Go code write provider.Duration(30*time.Second); Duration() gives the
// time.Duration back.
type Duration time.Duration

// Duration returns d as a time.Duration.
func (d Duration) Duration() time.Duration { return time.Duration(d) }

// String returns d in time.Duration's format, e.g. "1m30s".
func (d Duration) String() string { return time.Duration(d).String() }

// MarshalJSON writes d as a JSON string in time.ParseDuration syntax.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// durationRule is the rule a configured duration breaks, in every error.
const durationRule = `a duration is a string in time.ParseDuration syntax such as "30s", "2m" or "1h30m"`

// UnmarshalJSON reads a JSON string in time.ParseDuration syntax. Its
// errors are *json.UnmarshalTypeError, so encoding/json (and
// sigs.k8s.io/yaml, which decodes through it) names the struct and field in
// the text, e.g.
//
//	json: cannot unmarshal number 30 (a duration is a string in time.ParseDuration syntax such as "30s", "2m" or "1h30m"; a bare number would be read as nanoseconds) into Go struct field Config.callTimeout of type provider.Duration
func (d *Duration) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	if len(b) == 0 || b[0] != '"' {
		kind := "value"
		switch {
		case len(b) > 0 && (b[0] == '-' || '0' <= b[0] && b[0] <= '9'):
			kind = "number"
		case len(b) > 0 && b[0] == '{':
			kind = "object"
		case len(b) > 0 && b[0] == '[':
			kind = "array"
		case string(b) == "true" || string(b) == "false":
			kind = "bool"
		}
		desc := kind
		if kind == "number" {
			desc += " " + clipRaw(string(b)) + " (" + durationRule + "; a bare number would be read as nanoseconds)"
		} else {
			desc += " (" + durationRule + ")"
		}
		return typeError(desc)
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return typeError("string (" + durationRule + ")")
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return typeError("string " + errs.Quote(s) + " (" + durationRule + ")")
	}
	*d = Duration(v)
	return nil
}

func typeError(value string) error {
	return &json.UnmarshalTypeError{Value: value, Type: reflect.TypeFor[Duration]()}
}

// clipRaw bounds a raw JSON number for an error text.
func clipRaw(s string) string {
	const n = 40
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
