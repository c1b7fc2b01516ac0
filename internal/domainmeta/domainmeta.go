package domainmeta

import (
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// Namespace is the XML namespace of the element, the one kvm2 writes.
const Namespace = "https://egressproxy.dev/xmlns/instance/v1"

// Meta is what the library records in a domain's metadata.
type Meta struct {
	UID     string
	Created time.Time // UTC
	Entry   string
	Owner   string
	Port    int
	// SpecDigest is provider.Spec.Digest of the spec the domain was
	// created from; empty for domains created before it was recorded.
	SpecDigest string
}

// metaXML is the decoded form of the element.
type metaXML struct {
	XMLName xml.Name `xml:"https://egressproxy.dev/xmlns/instance/v1 instance"`
	UID     string   `xml:"https://egressproxy.dev/xmlns/instance/v1 uid"`
	Created string   `xml:"https://egressproxy.dev/xmlns/instance/v1 created"`
	Entry   string   `xml:"https://egressproxy.dev/xmlns/instance/v1 entry"`
	Owner   string   `xml:"https://egressproxy.dev/xmlns/instance/v1 owner"`
	Port    string   `xml:"https://egressproxy.dev/xmlns/instance/v1 port"`
	// SpecDigest is optional: domains created before it was recorded lack
	// it, and older readers ignore it.
	SpecDigest string `xml:"https://egressproxy.dev/xmlns/instance/v1 spec-digest"`
}

// ErrNoMetadata: the XML has no element of Namespace.
var ErrNoMetadata = errors.New("no " + Namespace + " metadata")

// Decode decodes the metadata element se (its start just read from dec)
// and checks it: uid, entry and owner present, created in RFC 3339, port
// 1-65535.
func Decode(dec *xml.Decoder, se *xml.StartElement) (Meta, error) {
	var mx metaXML
	if err := dec.DecodeElement(&mx, se); err != nil {
		return Meta{}, fmt.Errorf("parse domain metadata: %w", err)
	}
	m := Meta{UID: mx.UID, Entry: mx.Entry, Owner: mx.Owner, SpecDigest: strings.TrimSpace(mx.SpecDigest)}
	if m.UID == "" || m.Entry == "" || m.Owner == "" {
		return Meta{}, fmt.Errorf("parse domain metadata: uid, entry and owner are required")
	}
	var err error
	if m.Created, err = time.Parse(time.RFC3339Nano, strings.TrimSpace(mx.Created)); err != nil {
		return Meta{}, fmt.Errorf("parse domain metadata: created: %w", err)
	}
	m.Created = m.Created.UTC()
	if m.Port, err = strconv.Atoi(strings.TrimSpace(mx.Port)); err != nil || m.Port < 1 || m.Port > 65535 {
		return Meta{}, fmt.Errorf("parse domain metadata: port %q is not 1-65535", mx.Port)
	}
	return m, nil
}

// Parse finds the first element of Namespace named "instance" anywhere in
// doc (a whole domain XML, the inner XML of <metadata>, or the element
// itself) by a token scan, resolving namespace prefixes, and decodes it
// with Decode. ErrNoMetadata when absent; another error when doc is not
// well formed up to it or the element is malformed. It reads doc only up
// to that element. kvm2 reads domains in one pass that also finds the MAC;
// its tests check that pass against this scan.
func Parse(doc string) (Meta, error) {
	dec := xml.NewDecoder(strings.NewReader(doc))
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return Meta{}, ErrNoMetadata
		}
		if err != nil {
			return Meta{}, fmt.Errorf("parse domain metadata: %w", err)
		}
		se, ok := tok.(xml.StartElement)
		if !ok || se.Name.Space != Namespace || se.Name.Local != "instance" {
			continue
		}
		return Decode(dec, &se)
	}
}
