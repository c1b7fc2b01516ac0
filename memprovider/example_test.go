package memprovider_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

// The whole lifecycle of one instance, with a fake clock stepping it through
// provisioning: Create, Get until Running, List, Check, Delete, Close.
func Example() {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	p := memprovider.New(&memprovider.Options{
		ProvisionDelay: 30 * time.Second,
		Now:            func() time.Time { return now },
	})
	defer p.Close()

	spec := egressproxy.Spec{Name: "proxy-1", UID: "uid-1"}
	inst, err := p.Create(ctx, spec)
	if err != nil {
		fmt.Println("create:", err)
		return
	}
	fmt.Println(inst.State, inst.Address() == "", inst.CreatedAt.Format(time.RFC3339))

	now = now.Add(30 * time.Second) // provisioning is over
	inst, _ = p.Get(ctx, spec.Ref())
	fmt.Println(inst.State, inst.Address(), inst.SpecDigest == spec.Digest())

	list, _ := p.List(ctx)
	fmt.Println("listed:", len(list), list[0].Name)

	h, _ := p.Check(ctx)
	fmt.Println("reachable:", h.Reachable, h.Details["instances"])

	fmt.Println("delete:", p.Delete(ctx, spec.Ref()))
	_, err = p.Get(ctx, spec.Ref())
	fmt.Println("after delete:", egressproxy.Code(err))

	p.Close()
	_, err = p.List(ctx)
	fmt.Println("after close:", errors.Is(err, egressproxy.ErrClosed), egressproxy.Code(err))
	// Output:
	// Provisioning true 2026-01-01T12:00:00Z
	// Running 192.0.2.1:3128 true
	// listed: 1 proxy-1
	// reachable: true 1
	// delete: <nil>
	// after delete: NotFound
	// after close: true Permanent
}

// InjectFault makes calls fail on purpose, to test how an embedder handles
// each error class: here one Transient Create, then a Create that succeeds.
func ExampleControl_InjectFault() {
	ctx := context.Background()
	p := memprovider.New(nil)
	defer p.Close()
	var ctl *memprovider.Control
	p.As(&ctl)

	ctl.InjectFault(memprovider.OpCreate, memprovider.Fault{
		Code:  egressproxy.Transient,
		Err:   errors.New("hypervisor busy"),
		Times: 1,
	})
	spec := egressproxy.Spec{Name: "proxy-1", UID: "uid-1"}
	for attempt := 1; ; attempt++ {
		_, err := p.Create(ctx, spec)
		fmt.Printf("attempt %d: %v\n", attempt, egressproxy.Code(err))
		if !errors.Is(err, egressproxy.ErrTransient) {
			break
		}
	}
	// Output:
	// attempt 1: Transient
	// attempt 2: OK
}

// SetState forces an instance into a state a real backend may report, so an
// embedder can test its handling of crashed or stopped proxies.
func ExampleControl_SetState() {
	ctx := context.Background()
	p := memprovider.New(nil)
	defer p.Close()
	var ctl *memprovider.Control
	p.As(&ctl)

	spec := egressproxy.Spec{Name: "proxy-1", UID: "uid-1"}
	p.Create(ctx, spec)
	ctl.SetState(spec.Ref(), egressproxy.StateFailed)
	inst, _ := p.Get(ctx, spec.Ref())
	fmt.Println(inst.State)

	ctl.SetState(spec.Ref(), "") // back to normal
	inst, _ = p.Get(ctx, spec.Ref())
	fmt.Println(inst.State)

	err := ctl.SetState(egressproxy.Ref{Name: "proxy-2", UID: "uid-2"}, egressproxy.StateStopped)
	fmt.Println(egressproxy.Code(err))
	// Output:
	// Failed
	// Running
	// NotFound
}

// With ServeProxies a Running instance is a real HTTP CONNECT proxy on
// loopback: here it tunnels to a small echo server.
func ExampleOptions_serveProxies() {
	ctx := context.Background()
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println(err)
		return
	}
	done := make(chan struct{})
	defer func() { <-done }() // last: the echo server has ended
	defer echo.Close()
	go func() {
		defer close(done)
		c, err := echo.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.Copy(c, c)
	}()

	p := memprovider.New(&memprovider.Options{ServeProxies: true})
	defer p.Close()
	inst, err := p.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "uid-1"})
	if err != nil {
		fmt.Println(err)
		return
	}

	conn, err := net.Dial("tcp", inst.Address())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()
	target := echo.Addr().String()
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(resp.StatusCode)

	fmt.Fprint(conn, "ping\n")
	line, _ := br.ReadString('\n')
	fmt.Print(line)
	// Output:
	// 200
	// ping
}
