package egressproxy_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

// The README's first program: open an entry, create a proxy, read it back,
// delete it. TestREADMEProgram keeps the README's copy identical to this
// one, output included.
func Example_gettingStarted() {
	ctx := context.Background()

	// Open an entry. memprovider keeps proxies in memory; kvm2.Open opens a
	// libvirt host over SSH and returns the same *egressproxy.Client.
	client := memprovider.New(nil)
	defer client.Close()

	spec := egressproxy.Spec{Name: "proxy-1", UID: "0b7c6f1e-my-object"}
	inst, err := client.Create(ctx, spec) // idempotent on the UID
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("created", inst.Name, inst.State)

	inst, err = client.Get(ctx, spec.Ref()) // read back from the backend
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("got", inst.Name, inst.State, "on port", inst.Port)

	if err := client.Delete(ctx, spec.Ref()); err != nil { // idempotent
		log.Fatal(err)
	}
	_, err = client.Get(ctx, spec.Ref())
	fmt.Println("after delete:", egressproxy.Code(err), errors.Is(err, egressproxy.ErrNotFound))
	// Output:
	// created proxy-1 Running
	// got proxy-1 Running on port 3128
	// after delete: NotFound true
}
