package basecache_test

import (
	"fmt"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/sshconn"
)

// The pool volumes the cache keeps an image in: the base and, once the
// stored bytes were read back and hashed, the digest marker that makes it
// usable. Fetching needs a libvirt connection to the pool (a Cache from
// New, which kvm2 makes for each provider entry); naming does not.
func Example() {
	img := imagecache.Image{
		Key:    "debian-12",
		URL:    "https://mirror.example.net/debian-12-squid.qcow2",
		SHA256: "0f3c4e9a8b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e",
	}
	fmt.Println(img.Validate())

	base := basecache.BaseName("lab-1", img.Key, imagecache.FormatQCOW2)
	marker := basecache.MarkerName(base, img.SHA256)
	fmt.Println(base)
	fmt.Println(marker)

	entry, key, format, ok := basecache.ParseBaseName(base)
	fmt.Println(entry, key, format, ok)
	b, digest, ok := basecache.ParseMarkerName(marker)
	fmt.Println(b == base, digest == img.SHA256, ok)

	// Names of other schemes (kvm2's overlays, the older "base-<key>"
	// naming) are not bases.
	_, _, _, ok = basecache.ParseBaseName("ep-lab-1--proxy-1.qcow2")
	fmt.Println(ok)
	// Output:
	// <nil>
	// base-lab-1--debian-12.qcow2
	// base-lab-1--debian-12.qcow2.sha256-0f3c4e9a8b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e
	// lab-1 debian-12 qcow2 true
	// true true true
	// false
}

// New takes a Conn: basecache.SSH adapts a libvirt session over SSH (kvm2 does
// this for each provider entry). Nothing here touches the host: the first
// Ensure dials.
func ExampleNew() {
	pool, err := sshconn.New(sshconn.Config{
		Address: "hv1.example:22", User: "egress",
		KeyFile: "/etc/egress/id_ed25519", KnownHostsFile: "/etc/egress/known_hosts",
	}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	lv := libvirtconn.New(pool, libvirtconn.Config{}, nil)
	defer lv.Close()
	c, err := basecache.New(basecache.SSH(lv), basecache.Config{
		Entry:          "lab-1",
		Pool:           "default",
		TransferBudget: 20 * time.Minute,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	fmt.Println(c.BaseName(imagecache.Image{Key: "debian-12"}))

	// A Conn is required; the error names the field.
	_, err = basecache.New(basecache.SSH(nil), basecache.Config{Entry: "lab-1", Pool: "default"})
	for _, fe := range errs.FieldErrors(err) {
		fmt.Println(errs.Code(err), fe.Field)
	}
	// Output:
	// base-lab-1--debian-12.qcow2
	// Permanent conn
}
