package egressproxy_test

import (
	"context"
	"errors"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/kvm2"
	"github.com/egressproxy/egressproxy/provider"
	"github.com/egressproxy/egressproxy/sshconn"
)

// fieldErrors returns the Field of every *provider.FieldError in err's tree.
func fieldErrors(err error) []string {
	var out []string
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if fe, ok := e.(*provider.FieldError); ok {
			out = append(out, fe.Field)
		}
		switch u := e.(type) {
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	sort.Strings(out)
	return out
}

// TestConstructorsReportEveryFieldTheSameWay: bad input to any constructor
// returns one *provider.FieldError per violated field, all at once, with
// the same type in every package (classed Permanent where the package
// classes its errors).
func TestConstructorsReportEveryFieldTheSameWay(t *testing.T) {
	t.Parallel()
	_, sshErr := sshconn.New(sshconn.Config{Addr: "no-port", DialTimeout: -time.Second})
	_, cacheErr := imagecache.New(nil, imagecache.Config{Entry: "Bad_Entry"})
	_, trackErr := health.NewTracker(&health.TrackerOptions{Rise: -1, Fall: -1})
	_, kvmErr := kvm2.Open(context.Background(), kvm2.Config{}, nil)
	tests := []struct {
		name      string
		err       error
		want      []string // fields that must be named (at least these)
		permanent bool
	}{
		{"sshconn.New", sshErr, []string{"Addr", "DialTimeout", "KeyFile", "KnownHostsFile", "User"}, false},
		{"imagecache.New", cacheErr, []string{"Entry", "Pool", "conn"}, true},
		{"health.NewTracker", trackErr, []string{"TrackerOptions.Fall", "TrackerOptions.Rise"}, true},
		{"kvm2.Open", kvmErr, []string{"Address", "Entry"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if tt.err == nil {
				t.Fatal("no error for bad input")
			}
			got := fieldErrors(tt.err)
			for _, f := range tt.want {
				if !contains(got, f) {
					t.Errorf("fields named %v, want %s among them; error: %v", got, f, tt.err)
				}
			}
			var fe *provider.FieldError
			if !errors.As(tt.err, &fe) {
				t.Errorf("errors.As(*provider.FieldError) false for %v", tt.err)
			}
			if tt.permanent && provider.Code(tt.err) != provider.Permanent {
				t.Errorf("class %v, want Permanent", provider.Code(tt.err))
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
