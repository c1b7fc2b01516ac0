package egressproxy

import (
	"testing"

	"github.com/egressproxy/egressproxy/internal/errs"
)

// An error that already is an *OpError is not wrapped again.
func TestWrapOnce(t *testing.T) {
	err := wrap("get", "proxy-a", errs.Errorf(errs.NotFound, "domain missing"))
	if w := wrap("get", "x", err); w != err {
		t.Fatalf("double wrap: %v", w)
	}
	if got := err.Error(); got != "egressproxy get proxy-a: domain missing" {
		t.Fatalf("text = %q", got)
	}
}
