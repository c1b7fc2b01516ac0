package imagecache

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"unicode/utf8"
)

// Image URLs often carry credentials: a user name and password, a bearer
// token as user name, or a signed query (S3's X-Amz-Signature, GCS's
// X-Goog-Signature, Azure's sig, a plain token=). None of it may appear in
// an error, a log line or a span. Everything imagecache prints about a URL
// goes through RedactURL (or, for text that may embed one, redactText).

const (
	// maxURLText bounds a printed URL (bytes, before the "…" that marks a
	// cut).
	maxURLText = 300
	// maxErrText bounds the text of an error redactErr had to rewrite.
	maxErrText = 4096
	// redactedMark replaces every secret.
	redactedMark = "REDACTED"
	// minScrub: secrets shorter than this are not searched for as plain
	// text (they would match ordinary words); RedactURL removes them by
	// structure wherever they appear as part of a URL.
	minScrub = 6
)

// RedactURL returns rawURL fit for errors, logs and spans: the userinfo
// (user name and password) is replaced by "REDACTED", so are the values of
// credential-bearing query and fragment parameters (names compared without
// case: token, sig, signature, key, password, secret, auth, credential,
// session…, anything containing one of those, and every X-Amz-*, X-Goog-*,
// X-Ms-* and X-Oss-* parameter). Scheme, host, port, path and the other
// parameters stay readable. Text that does not parse as a URL is redacted
// conservatively (everything up to its last '@' counts as userinfo). The
// result is valid UTF-8 without control characters and at most
// maxURLText bytes plus "…".
func RedactURL(rawURL string) string {
	return clip(sanitize(redactURL(rawURL)), maxURLText)
}

func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Opaque != "" {
		return redactLoose(raw)
	}
	if u.User != nil {
		u.User = url.User(redactedMark)
	}
	u.RawQuery = redactParams(u.RawQuery)
	frag := u.EscapedFragment()
	hasFrag := frag != "" || strings.HasSuffix(raw, "#")
	u.Fragment, u.RawFragment = "", ""
	s := u.String()
	if hasFrag {
		s += "#" + redactParams(frag)
	}
	return s
}

// redactLoose redacts text that url.Parse refused (or an opaque URL): a
// password may then hold any of / ? # unescaped, so everything before the
// last '@' after the scheme is taken for userinfo.
func redactLoose(s string) string {
	scheme := ""
	if i := strings.Index(s, "://"); i > 0 && validScheme(s[:i]) {
		scheme, s = s[:i+3], s[i+3:]
	} else if i := strings.IndexByte(s, ':'); i > 0 && validScheme(s[:i]) {
		scheme, s = s[:i+1], s[i+1:]
	}
	if i := strings.LastIndexByte(s, '@'); i >= 0 {
		s = redactedMark + s[i:]
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
		out += "?" + redactParams(q)
	}
	if hasFrag {
		out += "#" + redactParams(frag)
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

// redactParams replaces the values of credential parameters in a raw
// query (or fragment) string; separators '&' and ';' and everything else
// are kept as they are.
func redactParams(q string) string {
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
		if name, _, ok := strings.Cut(p, "="); ok && isCredentialParam(name) {
			p = name + "=" + redactedMark
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

func isCredentialParam(raw string) bool {
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

// sanitize makes s valid UTF-8 without control characters: invalid bytes
// and control characters are percent-escaped (so nothing can forge a log
// line, and the bytes stay recognisable).
func sanitize(s string) string {
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

// clip cuts s to at most n bytes on a rune boundary, marking the cut.
func clip(s string, n int) string {
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

// redactText redacts every URL inside s, removes the secrets of rawURLs
// wherever they appear as plain text, and makes the result valid UTF-8.
func redactText(s string, rawURLs ...string) string {
	s = urlInText.ReplaceAllStringFunc(s, func(m string) string {
		// Punctuation that ends a sentence is not part of the URL.
		u := strings.TrimRight(m, ".,:;!?)]")
		return RedactURL(u) + m[len(u):]
	})
	for _, raw := range rawURLs {
		for _, sec := range secretsOf(raw) {
			s = strings.ReplaceAll(s, sec, redactedMark)
		}
	}
	return strings.ToValidUTF8(s, "\uFFFD")
}

// secretsOf returns the secrets rawURL carries (userinfo and credential
// parameter values, raw and unescaped) that are long enough to be searched
// for as text, longest first.
func secretsOf(raw string) []string {
	var out []string
	add := func(s string) {
		if len(s) >= minScrub && s != redactedMark {
			out = append(out, s)
		}
		if u, err := url.PathUnescape(s); err == nil && u != s && len(u) >= minScrub {
			out = append(out, u)
		}
		if u, err := url.QueryUnescape(s); err == nil && u != s && len(u) >= minScrub {
			out = append(out, u)
		}
	}
	params := func(q string) {
		for _, p := range strings.FieldsFunc(q, func(r rune) bool { return r == '&' || r == ';' }) {
			if name, v, ok := strings.Cut(p, "="); ok && isCredentialParam(name) {
				add(v)
			}
		}
	}
	if u, err := url.Parse(raw); err == nil && u.Opaque == "" {
		if u.User != nil {
			add(u.User.Username())
			if p, ok := u.User.Password(); ok {
				add(p)
			}
			add(u.User.String())
		}
		params(u.RawQuery)
		params(u.EscapedFragment())
	} else {
		s := raw
		if i := strings.Index(s, "://"); i >= 0 {
			s = s[i+3:]
		}
		if i := strings.LastIndexByte(s, '@'); i >= 0 {
			info := s[:i]
			add(info)
			for _, part := range strings.SplitN(info, ":", 2) {
				add(part)
			}
		}
		if _, after, ok := strings.Cut(s, "?"); ok {
			q, frag, _ := strings.Cut(after, "#")
			params(q)
			params(frag)
		} else if _, frag, ok := strings.Cut(s, "#"); ok {
			params(frag)
		}
	}
	// Longest first, so a secret containing a shorter one goes whole.
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && len(out[j]) > len(out[j-1]); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// quoted matches a Go-quoted string inside an error text.
var quoted = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

// redactErr returns err with every URL in its text redacted and the
// secrets of rawURL removed, valid UTF-8 and bounded. A *url.Error in the
// chain (net/http's errors embed the request URL; after redirects that is
// a URL never configured, e.g. a presigned one) is redacted in place, so
// errors.As finds only the redacted URL; the pieces of the URL a parse
// error quotes are dropped. When the text still needs changing, err is
// wrapped in an error with the redacted text that unwraps to err (so its
// class and errors.Is keep working).
func redactErr(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	walkErr(err, func(e error) {
		if ue, ok := e.(*url.Error); ok {
			ue.URL = RedactURL(ue.URL)
			if ue.Op == "parse" && ue.Err != nil {
				ue.Err = errors.New(quoted.ReplaceAllString(ue.Err.Error(), `"…"`))
			}
		}
	})
	msg := err.Error()
	safe := clip(redactText(msg, rawURL), maxErrText)
	if safe == msg {
		return err
	}
	return &redactedError{msg: safe, err: err}
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

// parseProblem describes why url.Parse refused a URL without quoting any
// piece of it (a piece may be part of a password).
func parseProblem(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) && ue.Err != nil {
		err = ue.Err
	}
	return clip(sanitize(quoted.ReplaceAllString(err.Error(), `"…"`)), 120)
}

// String prints the image with its URL redacted (RedactURL), so an Image
// can be printed with any fmt verb or logged as a value.
func (img Image) String() string {
	return fmt.Sprintf("{Key:%s URL:%s SHA256:%s Format:%s}", sanitize(clip(img.Key, 80)), RedactURL(img.URL), sanitize(clip(img.SHA256, 80)), sanitize(clip(img.Format, 20)))
}

// GoString is String for %#v.
func (img Image) GoString() string { return "imagecache.Image" + img.String() }

// MarshalLog gives logr sinks that do not use String (e.g. zapr) the image
// with its URL redacted.
func (img Image) MarshalLog() any {
	return struct{ Key, URL, SHA256, Format string }{img.Key, RedactURL(img.URL), img.SHA256, img.Format}
}
