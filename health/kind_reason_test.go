package health

import (
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
