package egressproxy_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// Spec.Validate reports every bad field at once, each as a *FieldError
// naming the field and the rule; the whole error is Permanent.
func ExampleSpec_Validate() {
	err := egressproxy.Spec{Name: "Proxy_1", Port: 70000, ImageKey: "debian--12"}.Validate()
	fmt.Println(egressproxy.Code(err))
	for _, fe := range egressproxy.FieldErrors(err) {
		fmt.Println(fe.Field)
	}

	var fe *egressproxy.FieldError
	fmt.Println(errors.As(err, &fe), fe.Field, fe.Value)

	fmt.Println(egressproxy.Spec{Name: "proxy-1", UID: "u1"}.Validate())
	// Output:
	// Permanent
	// Name
	// UID
	// Port
	// ImageKey
	// true Name Proxy_1
	// <nil>
}

// The digest fingerprints the spec an instance is created from, so an
// embedder sees drift without calling Create. Port is normalised (0 and
// DefaultPort digest alike); any other change gives another digest.
func ExampleSpec_Digest() {
	a := egressproxy.Spec{Name: "proxy-1", UID: "u1"}
	b := egressproxy.Spec{Name: "proxy-1", UID: "u1", Port: naming.DefaultPort}
	c := egressproxy.Spec{Name: "proxy-1", UID: "u1", Port: 8080}

	fmt.Println(a.Digest() == b.Digest(), a.Digest() == c.Digest())
	fmt.Println(a.EffectivePort(), c.EffectivePort())
	fmt.Println(len(a.Digest()), a.Digest()[:7])
	// Output:
	// true false
	// 3128 8080
	// 71 sha256:
}

// An Instance's Address joins IP and Port; it is empty while the instance
// has no address.
func ExampleInstance_Address() {
	inst := egressproxy.Instance{
		Ref:       egressproxy.Ref{Name: "proxy-1", UID: "u1"},
		CreatedAt: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC),
		State:     egressproxy.StateRunning,
		IP:        "fd00::5",
		Port:      3128,
	}
	fmt.Println(inst.Address())
	inst.IP = ""
	fmt.Printf("%q\n", inst.Address())
	// Output:
	// [fd00::5]:3128
	// ""
}
