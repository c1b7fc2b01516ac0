package redact

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
	"pgregory.net/rapid"
)

func TestRedactURL(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, in, want string
		secret         string // must not survive
	}{
		{"plain URL untouched", "https://mirror.example/deb/12.qcow2?v=3#top", "https://mirror.example/deb/12.qcow2?v=3#top", ""},
		{"password", "https://op:hunter2hunter2@mirror.example/a.qcow2", "https://REDACTED@mirror.example/a.qcow2", "hunter2hunter2"},
		{"user only (a token as user name)", "https://ghp_abcdef123456@host.example/a", "https://REDACTED@host.example/a", "ghp_abcdef123456"},
		{"escaped password", "http://u:p%40ss%2Fw%3Ford@h:8080/x", "http://REDACTED@h:8080/x", "p%40ss%2Fw%3Ford"},
		{"token", "https://h/x.qcow2?token=tok3n-s3cret&v=1", "https://h/x.qcow2?token=REDACTED&v=1", "tok3n-s3cret"},
		{"case-insensitive names", "https://h/x?ToKeN=AAAAsecret1&SIG=BBBBsecret2&Signature=CCCCsecret3", "https://h/x?ToKeN=REDACTED&SIG=REDACTED&Signature=REDACTED", "secret"},
		{"S3 presigned", "https://b.s3.amazonaws.com/k.qcow2?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20260101&X-Amz-Signature=deadbeefcafe&x-amz-security-token=FQoGZXIvYXdz",
			"https://b.s3.amazonaws.com/k.qcow2?X-Amz-Algorithm=REDACTED&X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED&x-amz-security-token=REDACTED", "deadbeefcafe"},
		{"GCS signed", "https://storage.googleapis.com/b/o?X-Goog-Signature=0a1b2c3d4e5f&X-Goog-Credential=sa%40p.iam", "https://storage.googleapis.com/b/o?X-Goog-Signature=REDACTED&X-Goog-Credential=REDACTED", "0a1b2c3d4e5f"},
		{"Azure SAS", "https://a.blob.core.windows.net/c/i.vhd?sv=2020-08-04&se=2026-01-01&sig=AzUrEsIgNaTuRe%3D", "https://a.blob.core.windows.net/c/i.vhd?sv=2020-08-04&se=2026-01-01&sig=REDACTED", "AzUrEsIgNaTuRe"},
		{"more credential names", "https://h/p?access_token=at123456&api_key=ak123456&password=pw123456&key=ky123456&client_secret=cs123456&credential=cr123456&auth=au123456",
			"https://h/p?access_token=REDACTED&api_key=REDACTED&password=REDACTED&key=REDACTED&client_secret=REDACTED&credential=REDACTED&auth=REDACTED", "123456"},
		{"escaped name", "https://h/p?%74oken=esc4pedsecret", "https://h/p?%74oken=REDACTED", "esc4pedsecret"},
		{"semicolon separator", "https://h/p?a=1;token=semis3cret", "https://h/p?a=1;token=REDACTED", "semis3cret"},
		{"fragment token", "https://h/p#access_token=fr4gsecret&x=1", "https://h/p#access_token=REDACTED&x=1", "fr4gsecret"},
		{"unparsable: password with a slash", "http://u:pa/ssw0rdsecret@h/x", "http://REDACTED@h/x", "ssw0rdsecret"},
		{"unparsable: control character", "http://u:ctlsecret\n@h/x?token=t0ksecret", "http://REDACTED@h/x?token=REDACTED", "secret"},
		{"opaque", "http:u:opaqu3secret@h/x", "http:REDACTED@h/x", "opaqu3secret"},
		{"not a URL", "ftp://u:ftps3cret@h/x", "ftp://REDACTED@h/x", "ftps3cret"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := URL(tt.in)
			if got != tt.want {
				t.Errorf("URL(%q)\n = %q\nwant %q", tt.in, got, tt.want)
			}
			if tt.secret != "" && strings.Contains(got, tt.secret) {
				t.Errorf("secret %q survived: %q", tt.secret, got)
			}
		})
	}
}

func TestRedactURLBoundedAndValidUTF8(t *testing.T) {
	t.Parallel()
	long := "https://h/" + strings.Repeat("é", 10000) + "?token=" + strings.Repeat("s", 10000)
	for _, in := range []string{long, "http://h/\xff\xfe?x=\xc3", "\x00\x01http://u:p@h"} {
		got := URL(in)
		if len(got) > maxURLText+len("…") || !utf8.ValidString(got) {
			t.Errorf("URL(%.40q…) = %.80q… (%d bytes, valid UTF-8 %v)", in, got, len(got), utf8.ValidString(got))
		}
		if strings.ContainsAny(got, "\x00\x01\n\r") {
			t.Errorf("control characters in %q", got)
		}
	}
}

// genSecret draws a secret that cannot occur in the generated hosts and
// paths (they use lowercase letters, digits, '-' and '.' only, the secret
// carries the uppercase marker "ZQX").
func genSecret(t *rapid.T) string {
	body := rapid.StringOfN(rapid.SampledFrom([]rune("abcXYZ019-._~!$&'()*+,;=:@/?#%[] \"<>é€")), 4, 24, -1).Draw(t, "secretBody")
	return "ZQX" + body
}

func genHost(t *rapid.T) string {
	labels := rapid.SliceOfN(rapid.StringMatching(`[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?`), 1, 4).Draw(t, "labels")
	h := strings.Join(labels, ".")
	if rapid.Bool().Draw(t, "port") {
		h += fmt.Sprintf(":%d", rapid.IntRange(1, 65535).Draw(t, "portNum"))
	}
	return h
}

var credentialNames = []string{"token", "sig", "signature", "access_token", "password", "key", "credential", "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "X-Goog-Signature", "X-Goog-Credential", "api_key", "apikey", "client_secret", "secret", "auth", "passwd", "id_token", "refresh_token", "session_token", "AWSAccessKeyId", "Signature"}

// Whatever URL carries it (in the user name, the password, the value of a
// credential parameter in the query or the fragment, escaped the way
// url.URL writes it), the secret never survives URL in any form, and
// the host and path stay readable.
func TestPropertyRedactURLHidesSecrets(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		secret := genSecret(t)
		u := url.URL{
			Scheme: rapid.SampledFrom([]string{"http", "https"}).Draw(t, "scheme"),
			Host:   genHost(t),
			Path:   "/" + strings.Join(rapid.SliceOfN(rapid.StringMatching(`[a-z0-9.-]{1,8}`), 0, 4).Draw(t, "path"), "/"),
		}
		q := url.Values{}
		for i := range rapid.IntRange(0, 3).Draw(t, "plainParams") {
			q.Set(fmt.Sprintf("p%d", i), rapid.StringMatching(`[a-z0-9]{0,6}`).Draw(t, "plainValue"))
		}
		name := rapid.SampledFrom(credentialNames).Draw(t, "credName")
		if rapid.Bool().Draw(t, "upper") {
			name = strings.ToUpper(name)
		}
		where := rapid.SampledFrom([]string{"user", "password", "query", "fragment"}).Draw(t, "where")
		switch where {
		case "user":
			u.User = url.User(secret)
		case "password":
			u.User = url.UserPassword(rapid.StringMatching(`[a-z]{1,6}`).Draw(t, "user"), secret)
		case "query":
			q.Set(name, secret)
		case "fragment":
			u.Fragment = name + "=" + secret
		}
		u.RawQuery = q.Encode()
		in := u.String()
		got := URL(in)
		for _, form := range []string{secret, url.QueryEscape(secret), url.PathEscape(secret), url.UserPassword("x", secret).String()[2:], url.User(secret).String()} {
			if strings.Contains(got, form) {
				t.Fatalf("secret (as %q) survived in %s: %q", form, where, got)
			}
		}
		if strings.Contains(got, "ZQX") {
			t.Fatalf("the secret marker survived: %q", got)
		}
		if !strings.Contains(got, u.Host) || !strings.Contains(got, u.EscapedPath()) {
			t.Fatalf("host %q / path %q not readable in %q", u.Host, u.EscapedPath(), got)
		}
		if !utf8.ValidString(got) {
			t.Fatalf("not valid UTF-8: %q", got)
		}
	})
}

// Arbitrary input: the output is bounded, valid UTF-8 and has no control
// characters (no log injection).
func TestPropertyRedactURLAnyInput(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		in := rapid.String().Draw(t, "in")
		got := URL(in)
		if len(got) > maxURLText+len("…") || !utf8.ValidString(got) {
			t.Fatalf("URL(%q) = %q", in, got)
		}
		for _, r := range got {
			if r < 0x20 || r == 0x7f {
				t.Fatalf("control character in %q", got)
			}
		}
	})
}

func TestRedactText(t *testing.T) {
	t.Parallel()
	const raw = "https://op:longpassword1@h.example/i.qcow2?token=longtoken22"
	for _, tt := range []struct{ in, want string }{
		{"GET https://op:longpassword1@h.example/i: 404", "GET https://REDACTED@h.example/i: 404"},
		{`Get "https://op:***@h.example/i?token=longtoken22": EOF.`, `Get "https://REDACTED@h.example/i?token=REDACTED": EOF.`},
		{"(see http://h/x?sig=abcdef123456), then", "(see http://h/x?sig=REDACTED), then"},
		{"server said: bad token longtoken22", "server said: bad token REDACTED"},
		{"echo longpassword1 and op:longpassword1", "echo REDACTED and REDACTED"},
		{"no URL at all \xff", "no URL at all \uFFFD"},
	} {
		if got := Text(tt.in, raw); got != tt.want {
			t.Errorf("Text(%q)\n = %q\nwant %q", tt.in, got, tt.want)
		}
	}
}

// Err keeps what callers test errors by: the class, errors.Is and
// errors.As (which then finds the redacted *url.Error).
func TestRedactErrKeepsClassAndChain(t *testing.T) {
	t.Parallel()
	const secret = "hunter2hunter2"
	raw := "http://op:" + secret + "@h.example/i"
	ue := &url.Error{Op: "Get", URL: "http://op:***@h.example/i?X-Amz-Signature=" + secret, Err: context.DeadlineExceeded}
	err := Err(errs.WithCode(errs.Transient, fmt.Errorf("GET %s: %w", raw, ue)), raw)
	if strings.Contains(err.Error(), secret) || !utf8.ValidString(err.Error()) {
		t.Fatalf("redacted error %q", err)
	}
	var got *url.Error
	if errs.Code(err) != errs.Transient || !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &got) || strings.Contains(got.Error(), secret) {
		t.Fatalf("class %v, Is deadline %v, url.Error %v", errs.Code(err), errors.Is(err, context.DeadlineExceeded), got)
	}
	plain := errors.New("nothing to hide")
	if Err(plain, raw) != plain {
		t.Fatal("an error without secrets was rewrapped")
	}
	huge := Err(errors.New(strings.Repeat("x", 1<<20)+"\xff"), raw)
	if len(huge.Error()) > maxErrText+len("…") || !utf8.ValidString(huge.Error()) {
		t.Fatalf("error of %d bytes not bounded", len(huge.Error()))
	}
}
