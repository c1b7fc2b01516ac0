package imagecache_test

import (
	"encoding/json"
	"fmt"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// An image as an embedder configures it (kvm2.Config.Images holds these).
// Validate reports nothing for a good one.
func Example() {
	img := imagecache.Image{
		Key:    "debian-12",
		URL:    "https://mirror.example.net/debian-12-squid.qcow2",
		SHA256: "0f3c4e9a8b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e",
	}
	fmt.Println(img.Validate())
	fmt.Println(img)
	// Output:
	// <nil>
	// {Key:debian-12 URL:https://mirror.example.net/debian-12-squid.qcow2 SHA256:0f3c4e9a8b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e Format:}
}

// Validate reports every bad field of an Image at once, Permanent; a URL in
// a field error is redacted.
func ExampleImage_Validate() {
	err := imagecache.Image{
		Key:    "Debian_12",
		URL:    "ftp://user:secret@mirror.example.net/debian.qcow2",
		SHA256: "ABC",
		Format: "vmdk",
	}.Validate()
	fmt.Println(errs.Code(err))
	for _, fe := range errs.FieldErrors(err) {
		fmt.Println(fe.Field, fe.Value)
	}
	// Output:
	// Permanent
	// Key Debian_12
	// URL ftp://REDACTED@mirror.example.net/debian.qcow2
	// SHA256 ABC
	// Format vmdk
}

// An image URL may carry credentials (userinfo, a signed query); they are
// sent, never printed: an Image prints, logs and marshals its URL with
// them replaced by REDACTED.
func ExampleImage_String() {
	for _, u := range []string{
		"https://user:pa55@mirror.example.net/img.qcow2",
		"https://bucket.example.net/img.qcow2?X-Amz-Signature=abc123&part=1",
		"https://mirror.example.net/img.qcow2?token=abc123",
	} {
		fmt.Println(imagecache.Image{Key: "debian-12", URL: u})
	}
	b, _ := json.Marshal(imagecache.Image{Key: "debian-12", URL: "https://user:pa55@mirror.example.net/img.qcow2"})
	fmt.Println(string(b))
	// Output:
	// {Key:debian-12 URL:https://REDACTED@mirror.example.net/img.qcow2 SHA256: Format:}
	// {Key:debian-12 URL:https://bucket.example.net/img.qcow2?X-Amz-Signature=REDACTED&part=1 SHA256: Format:}
	// {Key:debian-12 URL:https://mirror.example.net/img.qcow2?token=REDACTED SHA256: Format:}
	// {"key":"debian-12","url":"https://REDACTED@mirror.example.net/img.qcow2"}
}
