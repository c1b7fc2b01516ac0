package health

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
)

// Every Kind's Reason is a valid Kubernetes condition reason, distinct, and
// String's name in CamelCase.
func TestKindReason(t *testing.T) {
	valid := regexp.MustCompile(`^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`)
	seen := map[string]Kind{}
	for k := KindNone; k <= kindCount; k++ {
		r := k.Reason()
		if !valid.MatchString(r) {
			t.Errorf("%v.Reason() = %q, not a valid condition reason", k, r)
		}
		if o, dup := seen[r]; dup {
			t.Errorf("%v and %v share the reason %q", o, k, r)
		}
		seen[r] = k
		if k < kindCount && !strings.EqualFold(r, strings.ReplaceAll(k.String(), "-", "")) {
			t.Errorf("%v.Reason() = %q, not its String %q in CamelCase", k, r, k.String())
		}
	}
}

// A Kind is a plain value, not an error: a failure is matched with
// errors.As on *ProbeError and its Kind read there.
func TestKindIsNotAnError(t *testing.T) {
	if _, ok := any(KindTimeout).(error); ok {
		t.Fatal("Kind implements error")
	}
	var err error = &ProbeError{Kind: KindRefused, Op: "dial", Proxy: "127.0.0.1:1", Target: "example.test:443"}
	if pe := (*ProbeError)(nil); !errors.As(fmt.Errorf("wrapped: %w", err), &pe) || pe.Kind != KindRefused {
		t.Fatalf("errors.As through a wrap: %v", pe)
	}
}
