package imagecache

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/errs"
)

var okImage = Image{Key: "deb.12", URL: "http://mirror.invalid/deb.qcow2"}

func TestImageValidate(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name  string
		img   Image
		field string // "" = valid
	}{
		{"ok", okImage, ""},
		{"raw", Image{Key: "k", URL: "https://x/y", Format: "raw", SHA256: strings.Repeat("a", 64)}, ""},
		{"no key", Image{URL: "http://x"}, "Key"},
		{"key with --", Image{Key: "a--b", URL: "http://x"}, "Key"},
		{"key upper", Image{Key: "Deb", URL: "http://x"}, "Key"},
		{"no url", Image{Key: "k"}, "URL"},
		{"ftp url", Image{Key: "k", URL: "ftp://x"}, "URL"},
		{"short digest", Image{Key: "k", URL: "http://x", SHA256: "abc"}, "SHA256"},
		{"upper digest", Image{Key: "k", URL: "http://x", SHA256: strings.Repeat("A", 64)}, "SHA256"},
		{"bad format", Image{Key: "k", URL: "http://x", Format: "vmdk"}, "Format"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.img.Validate()
			if tt.field == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("Validate = %v, want Permanent naming %s", err, tt.field)
			}
		})
	}
}

// An Image never prints its URL's secrets: not through fmt (any verb), not
// through logr, not in Validate's errors.
func TestImageTextHidesSecrets(t *testing.T) {
	t.Parallel()
	const secret = "SeCrEt-0xC0FFEE"
	for _, img := range []Image{
		{Key: "k", URL: "https://op:" + secret + "@mirror.example/i.qcow2"},
		{Key: "k", URL: "https://mirror.example/i.qcow2?X-Amz-Signature=" + secret},
		{Key: "k", URL: "ftp://op:" + secret + "@mirror.example/i.qcow2"},        // invalid scheme
		{Key: "K", URL: "http://op:" + secret + "\x7f@mirror.example/i.qcow2"},   // invalid key, unparsable URL
		{Key: "k", URL: "http://op:" + secret + "/x@mirror.example:bad/i.qcow2"}, // unparsable URL
	} {
		texts := []string{fmt.Sprint(img), fmt.Sprintf("%v %+v %#v %s %q", img, img, img, img, img), fmt.Sprint([]Image{img}), fmt.Sprint(map[string]Image{"k": img})}
		if err := img.Validate(); err != nil {
			texts = append(texts, err.Error())
			var all []error
			collect(err, &all)
			for _, e := range all {
				texts = append(texts, e.Error(), fmt.Sprintf("%+v", e))
			}
		}
		for _, s := range texts {
			if strings.Contains(s, secret) {
				t.Errorf("%q printed the secret: %s", img.URL, s)
			}
		}
	}
	if err := (Image{Key: "k", URL: "http://h/x"}).Validate(); err != nil {
		t.Errorf("plain URL: %v", err)
	}
}

// collect appends err and every error it wraps.
func collect(err error, out *[]error) {
	if err == nil {
		return
	}
	*out = append(*out, err)
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		collect(u.Unwrap(), out)
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			collect(e, out)
		}
	}
	_ = errors.Unwrap
}
