package egressproxy

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// checkText fails unless err's text is valid UTF-8 of at most MaxErrorText
// bytes, and every line of it that quotes a value quotes it bounded.
func checkText(t *testing.T, err error) {
	t.Helper()
	if err == nil {
		return
	}
	msg := err.Error()
	if !utf8.ValidString(msg) || len(msg) > errs.MaxErrorText {
		t.Fatalf("error text is %d bytes, valid UTF-8 %v: %.200q", len(msg), utf8.ValidString(msg), msg)
	}
}

// FuzzErrorText: whatever the input, ValidateName, ValidateRef and
// Spec.Validate return errors whose text is valid UTF-8 of at most
// MaxErrorText bytes, each line naming its field with the value quoted
// (escaped, at most MaxQuoted bytes of it).
func FuzzErrorText(f *testing.F) {
	f.Add("proxy-1", "uid", 3128, "debian-12", "small", "#cloud-config")
	f.Add(strings.Repeat("a", 1<<20), strings.Repeat("\xff", 1<<20), -1, strings.Repeat("\x00", 1<<16), "\u202e", "")
	f.Add("a\xffb\n", "u\x1b[2J", 65536, "a--b", "Big_One", strings.Repeat("x", naming.MaxUserDataBytes+1))
	f.Add(strings.Repeat("\xe6\x97", 100), strings.Repeat("日", 200), 0, ".", "-", "")
	f.Fuzz(func(t *testing.T, name, uid string, port int, key, mt, ud string) {
		checkText(t, naming.ValidateName("Name", name))
		checkText(t, naming.ValidateRef(name, uid))
		err := Spec{Name: name, UID: uid, Port: port, ImageKey: key, MachineType: mt, UserData: ud}.Validate()
		checkText(t, err)
		if err == nil {
			return
		}
		// Each FieldError alone is bounded too, and never echoes
		// user-data.
		var joined interface{ Unwrap() []error }
		if !errors.As(err, &joined) {
			t.Fatalf("Validate error %v is not a join of FieldErrors", err)
		}
		for _, e := range joined.Unwrap() {
			checkText(t, e)
			var fe *errs.FieldError
			if !errors.As(e, &fe) {
				t.Fatalf("%v is not a FieldError", e)
			}
			if fe.Field == "UserData" && ud != "" && strings.Contains(e.Error(), ud) {
				t.Fatalf("user-data echoed: %v", e)
			}
		}
		// A FieldError with any value and rule is bounded.
		checkText(t, &errs.FieldError{Field: name, Value: uid, Rule: ud})
	})
}
