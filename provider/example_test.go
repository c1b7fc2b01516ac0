package provider_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/egressproxy/egressproxy/provider"
)

// A backend classes every error it returns exactly once; the caller reads
// the class with Code and decides with Retryable.
func Example() {
	busy := provider.Errorf(provider.Transient, "hypervisor busy")
	denied := provider.WithCode(provider.Permanent, errors.New("access denied"))
	missing := provider.WithCode(provider.NotFound, errors.New("no such domain"))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	stopped := provider.FromContext(ctx.Err())
	unclassed := errors.New("something a backend must not return")

	for _, err := range []error{nil, busy, denied, missing, stopped, unclassed} {
		fmt.Printf("%-16s retryable=%v\n", provider.Code(err), provider.Retryable(err))
	}
	// The class sentinels match with errors.Is; a context error still
	// matches the context's own error.
	fmt.Println(errors.Is(busy, provider.ErrTransient), errors.Is(denied, provider.ErrTransient))
	fmt.Println(errors.Is(stopped, context.Canceled))
	// Output:
	// OK               retryable=false
	// Transient        retryable=true
	// Permanent        retryable=false
	// NotFound         retryable=false
	// Canceled         retryable=false
	// Unknown          retryable=true
	// true false
	// true
}

// WithCode reclasses: the outer class wins, and the inner one no longer
// matches, so an error carries exactly one class.
func ExampleWithCode() {
	inner := provider.Errorf(provider.Transient, "volume still being written")
	outer := provider.WithCode(provider.Permanent, fmt.Errorf("create: %w", inner))

	fmt.Println(provider.Code(outer))
	fmt.Println(errors.Is(outer, provider.ErrPermanent), errors.Is(outer, provider.ErrTransient))
	fmt.Println(provider.WithCode(provider.Transient, nil) == nil)
	// Output:
	// Permanent
	// true false
	// true
}

// Spec.Validate reports every bad field at once, each as a *FieldError
// naming the field and the rule; the whole error is Permanent.
func ExampleSpec_Validate() {
	err := provider.Spec{Name: "Proxy_1", Port: 70000, ImageKey: "debian--12"}.Validate()
	fmt.Println(provider.Code(err))
	for _, fe := range provider.FieldErrors(err) {
		fmt.Println(fe.Field)
	}

	var fe *provider.FieldError
	fmt.Println(errors.As(err, &fe), fe.Field, fe.Value)

	fmt.Println(provider.Spec{Name: "proxy-1", UID: "u1"}.Validate())
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
	a := provider.Spec{Name: "proxy-1", UID: "u1"}
	b := provider.Spec{Name: "proxy-1", UID: "u1", Port: provider.DefaultPort}
	c := provider.Spec{Name: "proxy-1", UID: "u1", Port: 8080}

	fmt.Println(a.Digest() == b.Digest(), a.Digest() == c.Digest())
	fmt.Println(a.EffectivePort(), c.EffectivePort())
	fmt.Println(len(a.Digest()), a.Digest()[:7])
	// Output:
	// true false
	// 3128 8080
	// 71 sha256:
}

// ValidateName is the rule for instance and entry names (a lowercase DNS
// label without "--").
func ExampleValidateName() {
	for _, name := range []string{"proxy-1", "Proxy-1", "a--b", "-a", ""} {
		err := provider.ValidateName("Name", name)
		fmt.Printf("%q valid=%v\n", name, err == nil)
	}
	// Output:
	// "proxy-1" valid=true
	// "Proxy-1" valid=false
	// "a--b" valid=false
	// "-a" valid=false
	// "" valid=false
}

// An Instance's Address joins IP and Port; it is empty while the instance
// has no address.
func ExampleInstance_Address() {
	inst := provider.Instance{
		Ref:       provider.Ref{Name: "proxy-1", UID: "u1"},
		CreatedAt: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC),
		State:     provider.StateRunning,
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
