package kvm2

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden files of testdata/config")

// goldenSettings are a program's own keys of the multi-entry files.
type goldenSettings struct {
	Target         string        `json:"target"`
	RunningTimeout time.Duration `json:"runningTimeout"`
}

// Every file in testdata/config is read (ParseEntries for entries-*.yaml,
// with goldenSettings as the program's keys; ParseConfig for the others)
// and what it reports is compared with its .golden file: the class and
// the error's text, then each problem on a line of its own.
func TestConfigGolden(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob(filepath.Join("testdata", "config", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			if strings.HasPrefix(filepath.Base(file), "entries-") {
				var s goldenSettings
				_, err = ParseEntries(data, &s)
			} else {
				_, err = ParseConfig(data)
			}
			got := goldenText(err)
			golden := strings.TrimSuffix(file, ".yaml") + ".golden"
			if *updateGolden {
				if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatal(err)
			}
			if got != string(want) {
				t.Errorf("%s reports:\n%s\nwant (%s):\n%s", file, got, golden, want)
			}
		})
	}
}

// goldenText is what a golden file holds for err.
func goldenText(err error) string {
	if err == nil {
		return "ok\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n%s\n", errs.Code(err), err)
	for _, fe := range errs.FieldErrors(err) {
		fmt.Fprintf(&b, "--- field %q line %d value %q\n", fe.Field, fe.Line, fe.Value)
	}
	return b.String()
}

// Any input is either read or refused with a Permanent error whose text,
// and that of each problem, is valid UTF-8 and bounded; an entry that is
// read marshals to a file that reads back to it.
func FuzzParseEntries(f *testing.F) {
	files, _ := filepath.Glob(filepath.Join("testdata", "config", "*.yaml"))
	for _, file := range files {
		if b, err := os.ReadFile(file); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte("entries:\n- &a {entry: a, owner: o, address: 'h:22', user: u, pool: p}\n- {<<: [*a, *a], entry: b}\n"))
	f.Add([]byte("a: &a [x, x]\nb: &b [*a, *a]\nentries: [*b]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var s goldenSettings
		cfgs, err := ParseEntries(data, &s)
		if err != nil {
			if errs.Code(err) != errs.Permanent {
				t.Fatalf("%v: class %v", err, errs.Code(err))
			}
			for _, e := range append([]error{err}, fieldErrs(err)...) {
				if msg := e.Error(); !utf8.ValidString(msg) || len(msg) > errs.MaxErrorText {
					t.Fatalf("error text of %d bytes, UTF-8 %v", len(msg), utf8.ValidString(msg))
				}
			}
			return
		}
		for i, c := range cfgs {
			b, err := json.Marshal(c)
			if err != nil {
				t.Fatalf("entries[%d]: Marshal: %v", i, err)
			}
			if strings.Contains(string(b), "REDACTED") {
				continue // a credential in a URL is not written to a file
			}
			back, err := ParseConfig(b)
			if err != nil {
				t.Fatalf("entries[%d] marshalled to %s does not read back: %v", i, b, err)
			}
			if d := cmp.Diff(c, back, cmpopts.EquateEmpty()); d != "" {
				t.Fatalf("entries[%d] round trip (-read +reread):\n%s", i, d)
			}
		}
	})
}

func fieldErrs(err error) []error {
	var out []error
	for _, fe := range errs.FieldErrors(err) {
		out = append(out, fe)
	}
	return out
}

// Merge keys that refer to merge keys cannot make a small file expand
// without bound: the walk stops and says so.
func TestParseEntriesAliasBomb(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString("entries:\n  - &e0 {entry: a, owner: o, address: 'h:22', user: u, pool: p}\n")
	for i := 1; i <= 40; i++ {
		fmt.Fprintf(&b, "  - &e%d {<<: [*e%d, *e%d]}\n", i, i-1, i-1)
	}
	_, err := ParseEntries([]byte(b.String()), nil)
	found := false
	for _, fe := range errs.FieldErrors(err) {
		found = found || fe.Rule == "the document expands too far through aliases"
	}
	if errs.Code(err) != errs.Permanent || !found {
		t.Fatalf("ParseEntries = %v", err)
	}
}
