package imagecache

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/google/go-cmp/cmp"
	"sigs.k8s.io/yaml"
)

// A marshalled Image carries RedactURL's redaction of a credentialed URL,
// nothing of the secret, and any other URL exactly as given.
func TestImageMarshalRedacts(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, url, want string
		secret          []string
	}{
		{"plain", "https://mirror.example/deb/12.qcow2?v=3#top", "https://mirror.example/deb/12.qcow2?v=3#top", nil},
		{"plain, not normalised", "https://mirror.example/a%7Eb/c d.qcow2?x=1&y", "https://mirror.example/a%7Eb/c d.qcow2?x=1&y", nil},
		{"plain, longer than RedactURL's bound", "https://mirror.example/" + strings.Repeat("p", 2000) + ".qcow2", "https://mirror.example/" + strings.Repeat("p", 2000) + ".qcow2", nil},
		{"password", "https://op:hunter2hunter2@mirror.example/a.qcow2", "https://REDACTED@mirror.example/a.qcow2", []string{"hunter2hunter2", "op:"}},
		{"token as user", "https://ghp_abcdef123456@host.example/a", "https://REDACTED@host.example/a", []string{"ghp_abcdef123456"}},
		{"S3 presigned", "https://b.s3.amazonaws.com/k.qcow2?X-Amz-Credential=AKIAEXAMPLE%2F20260101&X-Amz-Signature=deadbeefcafe",
			"https://b.s3.amazonaws.com/k.qcow2?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED", []string{"AKIAEXAMPLE", "deadbeefcafe"}},
		{"Azure SAS", "https://a.blob.core.windows.net/c/i.vhd?sv=2020-08-04&sig=AzUrEsIgNaTuRe%3D", "https://a.blob.core.windows.net/c/i.vhd?sv=2020-08-04&sig=REDACTED", []string{"AzUrEsIgNaTuRe"}},
		{"fragment token", "https://h/p#access_token=fr4gsecret&x=1", "https://h/p#access_token=REDACTED&x=1", []string{"fr4gsecret"}},
		{"long signed URL", "https://h/" + strings.Repeat("p", 2000) + "?token=l0ngs3cret", "https://h/" + strings.Repeat("p", 2000) + "?token=REDACTED", []string{"l0ngs3cret"}},
		{"unparsable password", "http://u:pa/ssw0rdsecret@h/x", "http://REDACTED@h/x", []string{"ssw0rdsecret"}},
		{"control character", "http://u:ctlsecret\n@h/x?token=t0ksecret", "http://REDACTED@h/x?token=REDACTED", []string{"ctlsecret", "t0ksecret"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			img := Image{Key: "deb", URL: tt.url, SHA256: strings.Repeat("0", 64), Format: FormatRaw}
			b, err := json.Marshal(img)
			if err != nil {
				t.Fatal(err)
			}
			var got Image
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			if got.URL != tt.want {
				t.Errorf("marshalled URL = %q, want %q", got.URL, tt.want)
			}
			want := img
			want.URL = tt.want
			if d := cmp.Diff(want, got); d != "" {
				t.Errorf("round trip (-want +got):\n%s", d)
			}
			y, err := yaml.Marshal(img)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range tt.secret {
				for what, out := range map[string]string{"json": string(b), "yaml": string(y), "decoded": got.URL, "String": img.String()} {
					if strings.Contains(out, s) {
						t.Errorf("%s carries %q: %s", what, s, out)
					}
				}
			}
		})
	}
}

// An Image decoded from a marshalled config whose URL was redacted is
// refused by Validate, naming URL: fetching with "REDACTED" as the password
// would fail later and less clearly.
func TestImageRedactedURLRefused(t *testing.T) {
	t.Parallel()
	for _, u := range []string{
		"https://REDACTED@mirror.example/a.qcow2",
		"https://mirror.example/a.qcow2?X-Amz-Signature=REDACTED",
		"https://mirror.example/a.qcow2?v=1&token=REDACTED",
		"https://mirror.example/a.qcow2#access_token=REDACTED",
	} {
		err := Image{Key: "deb", URL: u}.Validate()
		var fe *errs.FieldError
		if errs.Code(err) != errs.Permanent || !errors.As(err, &fe) || fe.Field != "URL" || !strings.Contains(fe.Rule, "redacted") {
			t.Errorf("Validate(%q) = %v, want a Permanent FieldError on URL about the redaction", u, err)
		}
	}
	// The mark elsewhere is no credential.
	for _, u := range []string{"https://mirror.example/REDACTED.qcow2", "https://mirror.example/a.qcow2?label=REDACTED"} {
		if err := (Image{Key: "deb", URL: u}).Validate(); err != nil {
			t.Errorf("Validate(%q) = %v", u, err)
		}
	}
}
