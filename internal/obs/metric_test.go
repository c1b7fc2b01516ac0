package obs

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// Every instrument is documented in docs/observability.md's table, and
// every instrument the table names exists.
func TestInstrumentsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	_, metrics, ok := strings.Cut(string(doc), "\n## Metrics\n")
	if !ok {
		t.Fatal("docs/observability.md has no Metrics section")
	}
	rows := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(egressproxy\\.[a-z.]+)` \\|").FindAllStringSubmatch(metrics, -1) {
		rows[m[1]] = true
	}
	names := map[string]bool{}
	for _, n := range Instruments() {
		names[n] = true
		if !rows[n] {
			t.Errorf("instrument %s has no row in docs/observability.md", n)
		}
		if !regexp.MustCompile(`^egressproxy(\.[a-z]+)+$`).MatchString(n) {
			t.Errorf("instrument name %q is not egressproxy.<area>.<what>", n)
		}
	}
	for r := range rows {
		if !names[r] {
			t.Errorf("docs/observability.md documents %s, which is not an instrument", r)
		}
	}
}

// DurationBuckets are increasing, and every call gets its own slice.
func TestDurationBuckets(t *testing.T) {
	b := DurationBuckets()
	for i := 1; i < len(b); i++ {
		if b[i] <= b[i-1] {
			t.Fatalf("buckets not increasing at %d: %v", i, b)
		}
	}
	b[0] = -1
	if DurationBuckets()[0] == -1 {
		t.Error("DurationBuckets hands out a shared slice")
	}
}
