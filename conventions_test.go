package egressproxy_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/go-logr/logr/funcr"
	"go.opentelemetry.io/otel/metric"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/kvm2"
	"github.com/egressproxy/egressproxy/memprovider"
	"github.com/egressproxy/egressproxy/sshconn"
)

// TestConstructorsReportEveryFieldTheSameWay: bad input to any constructor
// returns one *egressproxy.FieldError per violated field, all at once, with
// the same type in every package (classed Permanent where the package
// classes its errors).
func TestConstructorsReportEveryFieldTheSameWay(t *testing.T) {
	t.Parallel()
	_, sshErr := sshconn.New(sshconn.Config{Address: "no-port", DialTimeout: -time.Second}, nil)
	_, cacheErr := basecache.New(nil, basecache.Config{Entry: "Bad_Entry"})
	_, trackErr := health.NewTracker(&health.TrackerOptions{Rise: -1, Fall: -1})
	_, kvmErr := kvm2.Open(context.Background(), kvm2.Config{}, nil)
	tests := []struct {
		name      string
		err       error
		want      []string // fields that must be named (at least these)
		permanent bool
	}{
		{"sshconn.New", sshErr, []string{"Address", "DialTimeout", "KeyFile", "KnownHostsFile", "User"}, false},
		{"basecache.New", cacheErr, []string{"Entry", "Pool", "conn"}, true},
		{"health.NewTracker", trackErr, []string{"Fall", "Rise"}, true},
		{"kvm2.Open", kvmErr, []string{"Address", "Entry"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if tt.err == nil {
				t.Fatal("no error for bad input")
			}
			var got []string
			for _, fe := range egressproxy.FieldErrors(tt.err) {
				got = append(got, fe.Field)
			}
			for _, f := range tt.want {
				if !contains(got, f) {
					t.Errorf("fields named %v, want %s among them; error: %v", got, f, tt.err)
				}
			}
			var fe *egressproxy.FieldError
			if !errors.As(tt.err, &fe) {
				t.Errorf("errors.As(*egressproxy.FieldError) false for %v", tt.err)
			}
			if tt.permanent && egressproxy.Code(tt.err) != egressproxy.Permanent {
				t.Errorf("class %v, want Permanent", egressproxy.Code(tt.err))
			}
		})
	}
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s || strings.HasSuffix(x, "."+s) {
			return true
		}
	}
	return false
}

// TestLogLinesStaySmall: a rejected call with a huge or non-UTF-8 name logs
// a bounded, valid UTF-8 line (the name is the caller's bad input, quoted
// and clipped), with the one key set.
func TestLogLinesStaySmall(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var lines []string
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, prefix+" "+args)
	}, funcr.Options{Verbosity: 1})
	c := memprovider.New(&memprovider.Options{Logger: log})
	defer c.Close()
	ctx := context.Background()
	for _, name := range []string{strings.Repeat("a", 1<<20), "bad\xffname", "x\x00y"} {
		_, _ = c.Create(ctx, egressproxy.Spec{Name: name, UID: "u"})
		_, _ = c.Get(ctx, egressproxy.Ref{Name: name, UID: "u"})
		_ = c.Delete(ctx, egressproxy.Ref{Name: name, UID: "u"})
	}
	mu.Lock()
	defer mu.Unlock()
	if len(lines) != 9 {
		t.Fatalf("%d lines, want 9: %q", len(lines), lines)
	}
	for _, l := range lines {
		if len(l) > 2048 || !utf8.ValidString(l) {
			t.Errorf("line of %d bytes (valid UTF-8 %v): %.200q", len(l), utf8.ValidString(l), l)
		}
		for _, k := range []string{`"op"=`, `"instance"=`, `"elapsed"=`, `"err"=`} {
			if !strings.Contains(l, k) {
				t.Errorf("line without %s: %.300s", k, l)
			}
		}
	}
}

// TestMeterProviderBesideTracerProvider: every options struct that takes a
// TracerProvider takes a MeterProvider right after it, of the metric API's
// type (docs/conventions.md, Constructors and configuration).
func TestMeterProviderBesideTracerProvider(t *testing.T) {
	mpType := reflect.TypeFor[metric.MeterProvider]()
	for _, typ := range []reflect.Type{
		reflect.TypeFor[egressproxy.Options](),
		reflect.TypeFor[kvm2.Options](),
		reflect.TypeFor[memprovider.Options](),
		reflect.TypeFor[health.TrackerOptions](),
		reflect.TypeFor[health.ProbeAllOptions](),
	} {
		tp, ok := typ.FieldByName("TracerProvider")
		if !ok {
			t.Errorf("%s has no TracerProvider", typ)
			continue
		}
		i := tp.Index[0] + 1
		if i >= typ.NumField() || typ.Field(i).Name != "MeterProvider" || typ.Field(i).Type != mpType {
			t.Errorf("%s: the field after TracerProvider is not MeterProvider %s", typ, mpType)
		}
	}
	if f, ok := reflect.TypeFor[sshconn.Options]().FieldByName("MeterProvider"); !ok || f.Type != mpType {
		t.Errorf("sshconn.Options has no MeterProvider %s", mpType)
	}
}
