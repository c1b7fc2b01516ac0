package health_test

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/egressproxy/egressproxy/health"
)

// A tracker turns probe results into decisions: two successes make a proxy
// healthy, three failures unhealthy, and a proxy whose address cannot be
// read keeps its state until the grace period has passed.
func ExampleTracker() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tr, err := health.NewTracker(&health.TrackerOptions{
		Rise: 2, Fall: 3, Grace: time.Minute,
		Now:      func() time.Time { return now },
		OnForget: func(s health.Status) { fmt.Println("forgot", s.ID) },
	})
	if err != nil {
		panic(err)
	}
	ok := health.Result{OK: true, Total: 2 * time.Millisecond}
	round := func(addr string) {
		tr.Update([]health.Observation{{ID: "proxy-a", Addr: addr, Result: ok}})
		s, _ := tr.Get("proxy-a")
		fmt.Println(now.Format("15:04:05"), s.State)
	}
	round("10.0.0.5:3128")
	round("10.0.0.5:3128")
	now = now.Add(30 * time.Second)
	round("") // address unknown for one round: still healthy
	now = now.Add(30 * time.Second)
	tr.Update(nil) // grace has passed since it was last seen
	fmt.Println(len(tr.Snapshot()), "tracked")
	// Output:
	// 00:00:00 unknown
	// 00:00:00 healthy
	// 00:00:30 healthy
	// forgot proxy-a
	// 0 tracked
}

// Probe one proxy: here a tiny in-process stand-in that answers every
// CONNECT with 200.
func ExampleProbe() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 512)
		c.Read(buf) // the CONNECT request (small enough for one read here)
		c.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n"))
		c.Read(buf) // until the probe closes
	}()
	res := health.Probe(context.Background(), ln.Addr().String(), "example.com:443",
		&health.ProbeOptions{Timeout: 5 * time.Second})
	<-done
	fmt.Println(res.OK, res.StatusCode, res.Kind, res.Total > 0)
	// Output: true 200 none true
}
