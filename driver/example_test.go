package driver_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
)

// A backend classes every error it returns exactly once with Errorf; the
// caller reads the class with egressproxy.Code or errors.Is. Errorf hides
// any class inside what it wraps, so the outer class is the only one.
func ExampleErrorf() {
	busy := driver.Errorf(egressproxy.Transient, "hypervisor busy")
	missing := driver.Errorf(egressproxy.NotFound, "no such domain")
	denied := driver.Errorf(egressproxy.Permanent, "define domain: %w", busy)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	unclassed := errors.New("something a backend must not return")

	for _, err := range []error{nil, busy, missing, denied, ctx.Err(), unclassed} {
		fmt.Println(egressproxy.Code(err))
	}
	fmt.Println(errors.Is(denied, egressproxy.ErrPermanent), errors.Is(denied, egressproxy.ErrTransient))
	// Output:
	// OK
	// Transient
	// NotFound
	// Permanent
	// Canceled
	// Unknown
	// true false
}
