package errs

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

const (
	// MaxErrorText is the bound, in bytes, of the text of every error the
	// library returns (see the package doc, "Error text").
	MaxErrorText = 1024
	// MaxQuoted bounds the escaped text Quote prints of a value, in bytes
	// (between the quotes, before the mark of a cut).
	MaxQuoted = 64
)

// Quote returns s fit to print in an error: double-quoted and escaped as
// strconv.Quote does (control characters, invalid UTF-8 and non-printable
// runes as \n, \x.., \u....), so the result is valid UTF-8 on one line. Long
// values are cut: at most MaxQuoted bytes of escaped text are kept, followed
// by an ellipsis and the length of the whole value, e.g.
//
//	"aaaaaaaaaaaa"… (1048576 bytes)
//
// The result is at most MaxQuoted+40 bytes long whatever s is. Every piece
// of caller input that enters an error goes through Quote.
func Quote(s string) string {
	if len(s) <= MaxQuoted {
		if q := strconv.Quote(s); len(q) <= MaxQuoted+2 {
			return q
		}
	}
	var b strings.Builder
	b.Grow(MaxQuoted + 40)
	b.WriteByte('"')
	i := 0
	for i < len(s) {
		_, n := utf8.DecodeRuneInString(s[i:])
		esc := strconv.Quote(s[i : i+n])
		esc = esc[1 : len(esc)-1]
		if b.Len()-1+len(esc) > MaxQuoted {
			break
		}
		b.WriteString(esc)
		i += n
	}
	if i == len(s) {
		b.WriteByte('"')
		return b.String()
	}
	b.WriteString(`"… (`)
	b.WriteString(strconv.Itoa(len(s)))
	b.WriteString(" bytes)")
	return b.String()
}

// ClipMessage returns s as valid UTF-8 (each invalid byte sequence replaced
// by U+FFFD) of at most MaxErrorText bytes: a longer text is cut on a rune
// boundary and ends with "… (N bytes cut)". Clipping composes: a text that
// already ends with such a mark (an inner layer clipped it, and an outer one
// added a prefix) is cut before the mark, and the new mark counts every byte
// cut by either. Error implementations at a package's outer layer (*Error,
// FieldError, egressproxy.OpError) pass their text through it, so no input
// can make an error text unbounded or invalid.
func ClipMessage(s string) string {
	if len(s) <= MaxErrorText && utf8.ValidString(s) {
		return s
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= MaxErrorText {
		return s
	}
	body, cut := s, 0
	if b, n, ok := cutMark(s); ok {
		body, cut = b, n
	}
	// The mark of the largest count possible bounds the real one.
	keep := MaxErrorText - len(clipMark(cut+len(body)))
	for keep > 0 && !utf8.RuneStart(body[keep]) {
		keep--
	}
	return body[:keep] + clipMark(cut+len(body)-keep)
}

func clipMark(n int) string { return "… (" + strconv.Itoa(n) + " bytes cut)" }

// cutMark splits a text that ends with a clipMark into the text before it
// and the count it gives.
func cutMark(s string) (string, int, bool) {
	const tail = " bytes cut)"
	if !strings.HasSuffix(s, tail) {
		return s, 0, false
	}
	i := strings.LastIndex(s, "… (")
	if i < 0 {
		return s, 0, false
	}
	n, err := strconv.Atoi(s[i+len("… (") : len(s)-len(tail)])
	if err != nil || n < 0 {
		return s, 0, false
	}
	return s[:i], n, true
}
