// Package metrictest reads what the module's instruments recorded, through
// the OpenTelemetry SDK's in-memory ManualReader, as a flat list of series
// that tests compare.
package metrictest

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Reader is a MeterProvider of the SDK with a ManualReader on it.
type Reader struct {
	mp *sdkmetric.MeterProvider
	r  *sdkmetric.ManualReader
}

// New returns a Reader whose MeterProvider is shut down when tb ends.
func New(tb testing.TB) *Reader {
	tb.Helper()
	r := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))
	tb.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return &Reader{mp: mp, r: r}
}

// MeterProvider is the provider to hand to the code under test.
func (r *Reader) MeterProvider() metric.MeterProvider { return r.mp }

// Kind is the aggregation a series has.
type Kind string

// The kinds of series.
const (
	Histogram Kind = "histogram"
	Counter   Kind = "counter" // a monotonic sum
	UpDown    Kind = "updown"  // a non-monotonic sum
	Gauge     Kind = "gauge"
)

// Series is one attribute set of one instrument as one collection saw it.
type Series struct {
	Scope string
	Name  string
	Unit  string
	Kind  Kind
	// Attrs maps each attribute key to its value (Value.String).
	Attrs map[string]string
	// Value is a sum's or a gauge's value.
	Value float64
	// Count and Sum are a histogram's.
	Count uint64
	Sum   float64
	// Bounds are a histogram's bucket boundaries.
	Bounds []float64
}

// Key is "name{k=v,...}" with the keys sorted: a series' identity.
func (s Series) Key() string { return Key(s.Name, s.Attrs) }

// Text is the series' value as tests compare it: a sum's or a gauge's
// value in its shortest form ("1", "0.5"), a histogram's "count N".
func (s Series) Text() string {
	if s.Kind == Histogram {
		return "count " + strconv.FormatUint(s.Count, 10)
	}
	return strconv.FormatFloat(s.Value, 'f', -1, 64)
}

// Key is the identity of the series name with attrs ("name{k=v,...}").
func Key(name string, attrs map[string]string) string {
	keys := make([]string, 0, len(attrs))
	for k := range attrs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	b.WriteString(name)
	b.WriteByte('{')
	for i, k := range keys {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=%s", k, attrs[k])
	}
	b.WriteByte('}')
	return b.String()
}

// Collect returns every series recorded so far, sorted by Key.
func (r *Reader) Collect(tb testing.TB) []Series {
	tb.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.r.Collect(context.Background(), &rm); err != nil {
		tb.Fatalf("collect metrics: %v", err)
	}
	var out []Series
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			base := Series{Scope: sm.Scope.Name, Name: m.Name, Unit: m.Unit}
			out = append(out, flatten(tb, base, m.Data)...)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key() < out[j].Key() })
	return out
}

func flatten(tb testing.TB, base Series, data metricdata.Aggregation) []Series {
	var out []Series
	add := func(kind Kind, set attribute.Set, v float64) {
		s := base
		s.Kind, s.Attrs, s.Value = kind, attrsOf(set), v
		out = append(out, s)
	}
	sumKind := func(mono bool) Kind {
		if mono {
			return Counter
		}
		return UpDown
	}
	switch d := data.(type) {
	case metricdata.Histogram[float64]:
		for _, p := range d.DataPoints {
			s := base
			s.Kind, s.Attrs, s.Count, s.Sum, s.Bounds = Histogram, attrsOf(p.Attributes), p.Count, p.Sum, p.Bounds
			out = append(out, s)
		}
	case metricdata.Sum[int64]:
		for _, p := range d.DataPoints {
			add(sumKind(d.IsMonotonic), p.Attributes, float64(p.Value))
		}
	case metricdata.Sum[float64]:
		for _, p := range d.DataPoints {
			add(sumKind(d.IsMonotonic), p.Attributes, p.Value)
		}
	case metricdata.Gauge[int64]:
		for _, p := range d.DataPoints {
			add(Gauge, p.Attributes, float64(p.Value))
		}
	case metricdata.Gauge[float64]:
		for _, p := range d.DataPoints {
			add(Gauge, p.Attributes, p.Value)
		}
	default:
		tb.Fatalf("metric %s: aggregation %T not handled", base.Name, data)
	}
	return out
}

func attrsOf(set attribute.Set) map[string]string {
	m := map[string]string{}
	for _, kv := range set.ToSlice() {
		m[string(kv.Key)] = kv.Value.String()
	}
	return m
}

// Named returns the series of the instrument name.
func Named(all []Series, name string) []Series {
	var out []Series
	for _, s := range all {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// Find returns the series of name whose attributes are exactly attrs.
func Find(all []Series, name string, attrs map[string]string) (Series, bool) {
	k := Key(name, attrs)
	for _, s := range all {
		if s.Key() == k {
			return s, true
		}
	}
	return Series{}, false
}

// Keys returns the Key of every series of name, sorted.
func Keys(all []Series, name string) []string {
	var out []string
	for _, s := range Named(all, name) {
		out = append(out, s.Key())
	}
	return out
}
