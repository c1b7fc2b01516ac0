package imagecache

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/redact"
)

// Image is one configured image.
type Image struct {
	// Key is the image key: same shape as egressproxy.Spec.ImageKey (1–63 of
	// a–z 0–9 . -, alphanumeric ends, no "--"). Required.
	Key string `json:"key,omitempty"`
	// URL is the http(s) URL of the image. Required. It may carry
	// credentials (userinfo, a signed query): they are sent, but never
	// printed — errors, logs, spans and String show the URL with the
	// userinfo and the values of credential parameters replaced by
	// "REDACTED", and a marshalled Image (JSON, YAML) carries that
	// redacted URL, so a credentialed URL is set in code (from a Secret),
	// not kept in a file.
	URL string `json:"url"`
	// SHA256 is the expected lowercase hex sha256 of the image file. Empty:
	// any digest is accepted and recorded.
	SHA256 string `json:"sha256,omitempty"`
	// Format is "qcow2" (zero value) or "raw". A qcow2 image must start
	// with the qcow2 magic ("QFI\xfb"): any other body (an error or
	// sign-in page served with 200, say) is refused, Permanent, before
	// anything is created in the pool. A raw image may hold any bytes.
	Format string `json:"format,omitempty"`
}

// Formats of an image.
const (
	FormatQCOW2 = "qcow2"
	FormatRaw   = "raw"
)

// Where a base came from: the "source" key of kvm2's "created" log line
// and of the image cache's "published base" line, and the span attribute
// imagecache.source. A fetch whose shared download switched sources on
// the way names them in order, joined by "+" ("peer+mirror").
const (
	// SourcePool: the base was already published in the pool (a hit).
	SourcePool = "pool"
	// SourceMirror: the fetch downloaded the image itself.
	SourceMirror = "mirror"
	// SourceShared: the fetch shared the mirror's download of another
	// entry's fetch of the same image.
	SourceShared = "shared"
	// SourceDetached: the fetch shared a download, fell behind it and
	// finished on a download of its own (a Range request from where it
	// was, or a full GET skipping what it had).
	SourceDetached = "detached"
	// SourcePeer: the fetch copied the base another entry had published
	// (from another host, alone or shared with other entries' fetches, or
	// inside its own host), instead of downloading the image.
	SourcePeer = "peer"
)

// Progress reports a transfer.
type Progress struct {
	Volume string
	Bytes  int64   // bytes sent so far
	Total  int64   // Content-Length, -1 when unknown
	Rate   float64 // bytes/s since the transfer started
}

// MarshalJSON writes the image with its URL redacted when the URL carries
// a credential (userinfo or a credential query or fragment parameter); any
// other URL is written as it is, so a file round-trips. A redacted URL
// fails Validate when decoded again, rather than fetching with a wrong
// credential.
func (img Image) MarshalJSON() ([]byte, error) {
	type plain Image // the fields and tags without the methods
	p := plain(img)
	if redact.HasCredentials(img.URL) {
		p.URL = redact.Unclipped(img.URL)
	}
	return json.Marshal(p)
}

// Validate checks the image and returns the violations joined (each a
// *egressproxy.FieldError), classed Permanent.
func (img Image) Validate() error {
	var problems []error
	if err := naming.ValidateKey("Key", img.Key); err != nil {
		problems = append(problems, err)
	}
	if p := urlProblem(img.URL); p != nil {
		problems = append(problems, p)
	}
	if img.SHA256 != "" && !isDigest(img.SHA256) {
		problems = append(problems, &errs.FieldError{Field: "SHA256", Value: img.SHA256, Rule: "must be 64 lowercase hex digits"})
	}
	if f := img.Format; f != "" && f != FormatQCOW2 && f != FormatRaw {
		problems = append(problems, &errs.FieldError{Field: "Format", Value: img.Format, Rule: `must be "qcow2" or "raw"`})
	}
	if len(problems) > 0 {
		return errs.WithCode(errs.Permanent, errors.Join(problems...))
	}
	return nil
}

// urlProblem is what is wrong with an image URL, nil when nothing is.
func urlProblem(raw string) *errs.FieldError {
	if raw == "" {
		return &errs.FieldError{Field: "URL", Rule: "is required"}
	}
	u, err := url.Parse(raw)
	var rule string
	switch {
	case !strings.HasPrefix(raw, "http://") && !strings.HasPrefix(raw, "https://"):
		rule = "must be an http:// or https:// URL"
	case err != nil:
		rule = "must parse as a URL: " + redact.ParseProblem(err)
	case u.Host == "":
		rule = "must name a host"
	case redact.CarriesMark(raw):
		rule = "carries a credential redacted by marshalling; set the URL with its credential in code (e.g. from a Secret)"
	default:
		return nil
	}
	return &errs.FieldError{Field: "URL", Value: redact.URL(raw), Rule: rule}
}

// isDigest reports whether d is 64 lowercase hex digits.
func isDigest(d string) bool {
	if len(d) != 64 {
		return false
	}
	for i := 0; i < len(d); i++ {
		if c := d[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// String prints the image with its URL redacted, so an Image can be
// printed with any fmt verb or logged as a value.
func (img Image) String() string {
	return fmt.Sprintf("{Key:%s URL:%s SHA256:%s Format:%s}", redact.Sanitize(redact.Clip(img.Key, 80)), redact.URL(img.URL), redact.Sanitize(redact.Clip(img.SHA256, 80)), redact.Sanitize(redact.Clip(img.Format, 20)))
}

// GoString is String for %#v.
func (img Image) GoString() string { return "imagecache.Image" + img.String() }

// MarshalLog gives logr sinks that do not use String (e.g. zapr) the image
// with its URL redacted.
func (img Image) MarshalLog() any {
	return struct{ Key, URL, SHA256, Format string }{img.Key, redact.URL(img.URL), img.SHA256, img.Format}
}
