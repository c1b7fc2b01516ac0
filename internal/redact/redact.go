package redact

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"unicode/utf8"
)

const (
	// maxURLText bounds a printed URL (bytes, before the "…" that marks a
	// cut).
	maxURLText = 300
	// maxErrText bounds the text of an error Err or View had to rewrite.
	maxErrText = 4096
	// Mark replaces every secret.
	Mark = "REDACTED"
	// minScrub: secrets shorter than this are not searched for as plain
	// text (they would match ordinary words); URL removes them by
	// structure wherever they appear as part of a URL.
	minScrub = 6
)

// URL returns rawURL fit for errors, logs and spans: the userinfo
// (user name and password) is replaced by "REDACTED", so are the values of
// credential-bearing query and fragment parameters (names compared without
// case: token, sig, signature, key, password, secret, auth, credential,
// session…, anything containing one of those, and every X-Amz-*, X-Goog-*,
// X-Ms-* and X-Oss-* parameter). Scheme, host, port, path and the other
// parameters stay readable. Text that does not parse as a URL is redacted
// conservatively (everything up to its last '@' counts as userinfo). The
// result is valid UTF-8 without control characters and at most
// maxURLText bytes plus "…".
func URL(rawURL string) string {
	return Clip(Sanitize(structural(rawURL)), maxURLText)
}

// Unclipped is URL without its length bound: the form a marshalled value
// carries, so that a long URL without credentials round-trips.
func Unclipped(rawURL string) string { return Sanitize(structural(rawURL)) }

// HasCredentials reports whether rawURL carries anything URL would
// redact.
func HasCredentials(rawURL string) bool {
	u, err := url.Parse(rawURL)
	if err != nil || u.Opaque != "" {
		return loose(rawURL) != rawURL
	}
	if u.User != nil {
		return true
	}
	q, f := u.RawQuery, u.EscapedFragment()
	return params(q) != q || params(f) != f
}

// CarriesMark reports whether rawURL carries a credential that is exactly
// Mark: a URL taken from a marshalled value.
func CarriesMark(rawURL string) bool {
	u, err := url.Parse(rawURL)
	if err != nil || u.Opaque != "" {
		return false
	}
	if u.User != nil && (u.User.Username() == Mark || u.User.String() == Mark) {
		return true
	}
	for _, q := range []string{u.RawQuery, u.EscapedFragment()} {
		for _, p := range splitParams(q) {
			if name, v, ok := strings.Cut(p, "="); ok && v == Mark && credentialParam(name) {
				return true
			}
		}
	}
	return false
}

// splitParams splits a raw query or fragment at '&' and ';'.
func splitParams(q string) []string {
	return strings.FieldsFunc(q, func(r rune) bool { return r == '&' || r == ';' })
}

func structural(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Opaque != "" {
		return loose(raw)
	}
	if u.User != nil {
		u.User = url.User(Mark)
	}
	u.RawQuery = params(u.RawQuery)
	frag := u.EscapedFragment()
	hasFrag := frag != "" || strings.HasSuffix(raw, "#")
	u.Fragment, u.RawFragment = "", ""
	s := u.String()
	if hasFrag {
		s += "#" + params(frag)
	}
	return s
}

// loose redacts text that url.Parse refused (or an opaque URL): a
// password may then hold any of / ? # unescaped, so everything before the
// last '@' after the scheme is taken for userinfo.
func loose(s string) string {
	scheme := ""
	if i := strings.Index(s, "://"); i > 0 && validScheme(s[:i]) {
		scheme, s = s[:i+3], s[i+3:]
	} else if i := strings.IndexByte(s, ':'); i > 0 && validScheme(s[:i]) {
		scheme, s = s[:i+1], s[i+1:]
	}
	if i := strings.LastIndexByte(s, '@'); i >= 0 {
		s = Mark + s[i:]
	}
	frag, hasFrag := "", false
	if i := strings.IndexByte(s, '#'); i >= 0 {
		s, frag, hasFrag = s[:i], s[i+1:], true
	}
	q, hasQ := "", false
	if i := strings.IndexByte(s, '?'); i >= 0 {
		s, q, hasQ = s[:i], s[i+1:], true
	}
	out := scheme + s
	if hasQ {
		out += "?" + params(q)
	}
	if hasFrag {
		out += "#" + params(frag)
	}
	return out
}

func validScheme(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
		case i > 0 && ('0' <= c && c <= '9' || c == '+' || c == '-' || c == '.'):
		default:
			return false
		}
	}
	return s != ""
}

// params replaces the values of credential parameters in a raw
// query (or fragment) string; separators '&' and ';' and everything else
// are kept as they are.
func params(q string) string {
	if q == "" {
		return q
	}
	var b strings.Builder
	start := 0
	for i := 0; i <= len(q); i++ {
		if i < len(q) && q[i] != '&' && q[i] != ';' {
			continue
		}
		p := q[start:i]
		if name, _, ok := strings.Cut(p, "="); ok && credentialParam(name) {
			p = name + "=" + Mark
		}
		b.WriteString(p)
		if i < len(q) {
			b.WriteByte(q[i])
		}
		start = i + 1
	}
	return b.String()
}

var credentialPrefixes = []string{"x-amz-", "x-goog-", "x-ms-", "x-oss-"}

// credentialWords: a parameter whose name (lowercase, without - _ . and
// spaces) contains one of these carries a credential. Generous on purpose:
// an over-redacted harmless parameter costs a little readability, a missed
// one leaks a secret.
var credentialWords = []string{"token", "sig", "secret", "pass", "pwd", "key", "auth", "cred", "session", "jwt"}

func credentialParam(raw string) bool {
	name, err := url.QueryUnescape(raw)
	if err != nil {
		name = raw
	}
	n := strings.ToLower(name)
	for _, p := range credentialPrefixes {
		if strings.HasPrefix(n, p) {
			return true
		}
	}
	n = strings.NewReplacer("-", "", "_", "", ".", "", " ", "").Replace(n)
	for _, w := range credentialWords {
		if strings.Contains(n, w) {
			return true
		}
	}
	return false
}

// Sanitize makes s valid UTF-8 without control characters: invalid bytes
// and control characters are percent-escaped (so nothing can forge a log
// line, and the bytes stay recognisable).
func Sanitize(s string) string {
	ok := true
	for _, r := range s {
		if r == utf8.RuneError || r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			ok = false
			break
		}
	}
	if ok {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && n <= 1) || r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			for _, c := range []byte(s[i : i+n]) {
				fmt.Fprintf(&b, "%%%02X", c)
			}
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// Clip cuts s to at most n bytes on a rune boundary, marking the cut.
func Clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

// urlInText finds URLs inside free text (error messages): scheme://, up to
// whitespace, a quote or an angle bracket.
var urlInText = regexp.MustCompile("(?i)[a-z][a-z0-9+.-]*://[^\\s\"'<>`]+")

// Text redacts every URL inside s, removes the secrets of rawURLs
// wherever they appear as plain text, and makes the result valid UTF-8.
func Text(s string, rawURLs ...string) string {
	s = urlInText.ReplaceAllStringFunc(s, func(m string) string {
		// Punctuation that ends a sentence is not part of the URL.
		u := strings.TrimRight(m, ".,:;!?)]")
		return URL(u) + m[len(u):]
	})
	for _, raw := range rawURLs {
		for _, sec := range Secrets(raw) {
			s = strings.ReplaceAll(s, sec, Mark)
		}
	}
	return strings.ToValidUTF8(s, "\uFFFD")
}

// Secrets returns the secrets rawURL carries (userinfo and credential
// parameter values, raw and unescaped) that are long enough to be searched
// for as text, longest first, so that a secret containing a shorter one
// is replaced whole.
func Secrets(raw string) []string {
	var s secrets
	if u, err := url.Parse(raw); err == nil && u.Opaque == "" {
		s.ofURL(u)
	} else {
		s.ofLoose(raw)
	}
	slices.SortStableFunc(s.out, func(a, b string) int { return len(b) - len(a) })
	return s.out
}

// secrets collects the secrets of one URL.
type secrets struct{ out []string }

// add keeps v, and its unescaped forms, when long enough to search for.
func (s *secrets) add(v string) {
	if len(v) >= minScrub && v != Mark {
		s.out = append(s.out, v)
	}
	if u, err := url.PathUnescape(v); err == nil && u != v && len(u) >= minScrub {
		s.out = append(s.out, u)
	}
	if u, err := url.QueryUnescape(v); err == nil && u != v && len(u) >= minScrub {
		s.out = append(s.out, u)
	}
}

// params adds the values of the credential parameters of a raw query or
// fragment.
func (s *secrets) params(q string) {
	for _, p := range splitParams(q) {
		if name, v, ok := strings.Cut(p, "="); ok && credentialParam(name) {
			s.add(v)
		}
	}
}

// ofURL adds the secrets of a parsed URL.
func (s *secrets) ofURL(u *url.URL) {
	if u.User != nil {
		s.add(u.User.Username())
		if p, ok := u.User.Password(); ok {
			s.add(p)
		}
		s.add(u.User.String())
	}
	s.params(u.RawQuery)
	s.params(u.EscapedFragment())
}

// ofLoose adds the secrets of text url.Parse refused, read as loose does:
// everything before the last '@' after the scheme is userinfo.
func (s *secrets) ofLoose(raw string) {
	rest := raw
	if i := strings.Index(rest, "://"); i >= 0 {
		rest = rest[i+3:]
	}
	if i := strings.LastIndexByte(rest, '@'); i >= 0 {
		info := rest[:i]
		s.add(info)
		for _, part := range strings.SplitN(info, ":", 2) {
			s.add(part)
		}
	}
	if _, after, ok := strings.Cut(rest, "?"); ok {
		q, frag, _ := strings.Cut(after, "#")
		s.params(q)
		s.params(frag)
	} else if _, frag, ok := strings.Cut(rest, "#"); ok {
		s.params(frag)
	}
}

// quoted matches a Go-quoted string inside an error text.
var quoted = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

// Err returns err with every URL in its text redacted and the
// secrets of rawURL removed, valid UTF-8 and bounded. A *url.Error in the
// chain (net/http's errors embed the request URL; after redirects that is
// a URL never configured, e.g. a presigned one) is redacted in place, so
// errors.As finds only the redacted URL; the pieces of the URL a parse
// error quotes are dropped. When the text still needs changing, err is
// wrapped in an error with the redacted text that unwraps to err (so its
// class and errors.Is keep working).
func Err(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	walkErr(err, func(e error) {
		if ue, ok := e.(*url.Error); ok {
			ue.URL = URL(ue.URL)
			if ue.Op == "parse" && ue.Err != nil {
				ue.Err = errors.New(quoted.ReplaceAllString(ue.Err.Error(), `"…"`))
			}
		}
	})
	msg := err.Error()
	safe := Clip(Text(msg, rawURL), maxErrText)
	if safe == msg {
		return err
	}
	return &redactedError{msg: safe, err: err}
}

// View returns an error whose text is err's with every URL redacted and
// the secrets of rawURL removed, valid UTF-8 and bounded, and which
// unwraps to err; err itself is not changed (several callers may hold
// it). err when its text needs no change.
func View(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if safe := Clip(Text(msg, rawURL), maxErrText); safe != msg {
		return &redactedError{msg: safe, err: err}
	}
	return err
}

// walkErr calls fn on err and every error it wraps.
func walkErr(err error, fn func(error)) {
	for depth := 0; err != nil && depth < 100; depth++ {
		fn(err)
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				walkErr(e, fn)
			}
			return
		default:
			return
		}
	}
}

// redactedError is an error whose text was redacted.
type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }

// ParseProblem describes why url.Parse refused a URL without quoting any
// piece of it (a piece may be part of a password).
func ParseProblem(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) && ue.Err != nil {
		err = ue.Err
	}
	return Clip(Sanitize(quoted.ReplaceAllString(err.Error(), `"…"`)), 120)
}
