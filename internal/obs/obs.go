package obs

import (
	"context"
	"strings"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// The attribute keys of the convention.
const (
	// KeyEntry is the provider entry (one host and pool).
	KeyEntry = attribute.Key("egressproxy.entry")
	// KeyInstance is the instance (proxy) name as the caller gave it.
	KeyInstance = attribute.Key("egressproxy.instance")
	// KeyVolume is the storage volume the operation is about.
	KeyVolume = attribute.Key("egressproxy.volume")
	// KeyErrorType is OpenTelemetry's error.type, set only on failure.
	KeyErrorType = attribute.Key("error.type")
)

// ErrorTypeOther is the error.type of an error without a class, the
// semantic conventions' fallback value.
const ErrorTypeOther = "_OTHER"

// MaxAttrLen bounds every string attribute value and the status
// description, in bytes.
const MaxAttrLen = 256

// Attrs are the convention's attributes of one span; empty fields are
// left out.
type Attrs struct {
	Entry    string
	Instance string
	Volume   string
}

// KeyValues returns a's non-empty attributes.
func (a Attrs) KeyValues() []attribute.KeyValue {
	kv := make([]attribute.KeyValue, 0, 3)
	for _, f := range [...]struct {
		k attribute.Key
		v string
	}{{KeyEntry, a.Entry}, {KeyInstance, a.Instance}, {KeyVolume, a.Volume}} {
		if f.v != "" {
			kv = append(kv, f.k.String(Bound(f.v)))
		}
	}
	return kv
}

// Start starts the span name with a's attributes and extra ones. Extra
// string attributes that are empty are left out, the others bounded like
// a's.
func Start(ctx context.Context, t trace.Tracer, name string, a Attrs, extra ...attribute.KeyValue) (context.Context, trace.Span) {
	kv := a.KeyValues()
	kv = append(kv, Clean(extra)...)
	return t.Start(ctx, name, trace.WithAttributes(kv...))
}

// Clean returns kvs without empty string attributes and with every string
// value bounded (see Bound).
func Clean(kvs []attribute.KeyValue) []attribute.KeyValue {
	out := make([]attribute.KeyValue, 0, len(kvs))
	for _, kv := range kvs {
		if kv.Value.Type() == attribute.STRING {
			s := kv.Value.AsString()
			if s == "" {
				continue
			}
			kv = kv.Key.String(Bound(s))
		}
		out = append(out, kv)
	}
	return out
}

// Fail marks span failed with err (nothing for a nil err): error.type,
// status Error with err's text bounded, and err recorded. The caller has
// removed any secret from err's text.
func Fail(span trace.Span, err error) {
	if err == nil {
		return
	}
	span.SetAttributes(KeyErrorType.String(ErrorType(err)))
	span.SetStatus(codes.Error, Bound(err.Error()))
	span.RecordError(err)
}

// End ends span, failed with err when err is not nil (see Fail).
func End(span trace.Span, err error) {
	Fail(span, err)
	span.End()
}

// ErrorType is the error.type of err: its class, ErrorTypeOther for an
// error without one, "" for nil.
func ErrorType(err error) string {
	switch c := errs.Code(err); c {
	case errs.OK:
		return ""
	case errs.Unknown:
		return ErrorTypeOther
	default:
		return c.String()
	}
}

// Bound returns s as valid UTF-8 (invalid bytes become U+FFFD) of at most
// MaxAttrLen bytes, cut at a rune boundary and marked with "…" when cut.
func Bound(s string) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if len(s) <= MaxAttrLen {
		return s
	}
	const mark = "…"
	n := MaxAttrLen - len(mark)
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + mark
}
