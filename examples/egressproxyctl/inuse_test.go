package main

import (
	"testing"

	"github.com/egressproxy/egressproxy"
)

// The IN USE BY column never shows a base whose users are unknown as
// unused.
func TestInUseByColumn(t *testing.T) {
	for _, tc := range []struct {
		info egressproxy.ImageInfo
		want string
	}{
		{egressproxy.ImageInfo{}, ""},
		{egressproxy.ImageInfo{InUseBy: []string{"a", "b"}}, "a,b"},
		{egressproxy.ImageInfo{InUseUnknown: true}, "(unknown)"},
		{egressproxy.ImageInfo{InUseBy: []string{"a"}, InUseUnknown: true}, "a,(unknown)"},
	} {
		if got := inUseBy(tc.info); got != tc.want {
			t.Errorf("inUseBy(%+v) = %q, want %q", tc.info, got, tc.want)
		}
	}
}
