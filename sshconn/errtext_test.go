package sshconn

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
)

// TestErrorTextBounded: sshconn's errors are valid UTF-8 and at most
// errs.MaxErrorText bytes, whatever the input (here a 1 MiB address
// with invalid UTF-8 in it, through Validate).
func TestErrorTextBounded(t *testing.T) {
	t.Parallel()
	addr := strings.Repeat("h\xff", 1<<19) + ":22"
	_, err := New(Config{Address: addr, User: strings.Repeat("u", 1<<20)}, nil)
	if err == nil {
		t.Fatal("no error")
	}
	s := err.Error()
	if len(s) > errs.MaxErrorText || !utf8.ValidString(s) {
		t.Errorf("error of %d bytes (valid UTF-8 %v), want at most %d", len(s), utf8.ValidString(s), errs.MaxErrorText)
	}
	if errKind(err) != KindConfig || len(errs.FieldErrors(err)) == 0 {
		t.Errorf("kind %v, %d field errors", errKind(err), len(errs.FieldErrors(err)))
	}
}
