package errs

import (
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"pgregory.net/rapid"
)

func TestQuote(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"", `""`},
		{"proxy-1", `"proxy-1"`},
		{"a\nb\x00", `"a\nb\x00"`},
		{"ü\xff", `"ü\xff"`},
		{strings.Repeat("a", 64), `"` + strings.Repeat("a", 64) + `"`},
		{strings.Repeat("a", 65), `"` + strings.Repeat("a", 64) + `"… (65 bytes)`},
		{strings.Repeat("a", 1<<20), `"` + strings.Repeat("a", 64) + `"… (1048576 bytes)`},
		// Escapes count with their escaped length and are never cut.
		{strings.Repeat("\xff", 20), `"` + strings.Repeat(`\xff`, 16) + `"… (20 bytes)`},
		{"a" + strings.Repeat("\x00", 20), `"a` + strings.Repeat(`\x00`, 15) + `"… (21 bytes)`},
	} {
		if got := Quote(tt.in); got != tt.want {
			t.Errorf("Quote(%.20q) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

func TestPropertyQuoteBounded(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := rapid.OneOf(rapid.String(), rapid.StringN(0, 300, -1),
			rapid.Map(rapid.SliceOfN(rapid.Byte(), 0, 300), func(b []byte) string { return string(b) })).Draw(t, "s")
		q := Quote(s)
		if !utf8.ValidString(q) || len(q) > MaxQuoted+40 || strings.ContainsAny(q, "\n\r\x00") {
			t.Fatalf("Quote(%q) = %q: invalid, multi-line or too long (%d bytes)", s, q, len(q))
		}
		if len(s) <= MaxQuoted/4 && q != strconv.Quote(s) {
			t.Fatalf("short value %q not quoted whole: %s", s, q)
		}
	})
}

func TestClipMessage(t *testing.T) {
	if got := ClipMessage("short"); got != "short" {
		t.Fatal(got)
	}
	if got := ClipMessage("a\xffb"); got != "a\uFFFDb" {
		t.Fatalf("%q", got)
	}
	long := strings.Repeat("ü", 1000) // 2000 bytes
	got := ClipMessage(long)
	want := strings.Repeat("ü", 502) + "… (996 bytes cut)" // 1004+19 bytes
	if got != want {
		t.Fatalf("ClipMessage(2000 bytes) = %d bytes …%q", len(got), got[len(got)-30:])
	}
	// Clipping composes: a prefix added to a clipped text is cut again and
	// the mark counts every byte cut.
	again := ClipMessage("outer: " + got)
	if !strings.HasSuffix(again, "… (1004 bytes cut)") || !strings.HasPrefix(again, "outer: üü") || len(again) > MaxErrorText {
		t.Fatalf("ClipMessage(prefix + clipped) = %d bytes …%q", len(again), again[len(again)-30:])
	}
	rapid.Check(t, func(t *rapid.T) {
		s := string(rapid.SliceOfN(rapid.Byte(), 0, 3000).Draw(t, "s"))
		got := ClipMessage(s)
		if !utf8.ValidString(got) || len(got) > MaxErrorText {
			t.Fatalf("ClipMessage: %d bytes, valid %v", len(got), utf8.ValidString(got))
		}
		if utf8.ValidString(s) && len(s) <= MaxErrorText && got != s {
			t.Fatalf("ClipMessage changed a valid short text")
		}
		// Composed with a prefix, the cut count is what the prefixed,
		// repaired text lost.
		prefix := rapid.StringN(0, 100, -1).Draw(t, "prefix")
		full := prefix + strings.ToValidUTF8(s, "\uFFFD")
		twice := ClipMessage(prefix + got)
		if len(twice) > MaxErrorText || !utf8.ValidString(twice) {
			t.Fatalf("ClipMessage twice: %d bytes", len(twice))
		}
		if body, n, ok := cutMark(twice); ok && len(full) > MaxErrorText {
			if len(body)+n != len(full) || !strings.HasPrefix(full, body) {
				t.Fatalf("composed clip kept %d bytes and counts %d cut; the text had %d", len(body), n, len(full))
			}
		}
	})
}
