package health_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy/health"
)

// standIn serves a tiny in-process stand-in for a proxy on loopback: it
// answers every CONNECT with 200 and holds the connection until the probe
// closes it. stop closes it and waits for its goroutines.
func standIn() (address string, stop func()) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 512)
				c.Read(buf) // the CONNECT request (small enough for one read here)
				c.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n"))
				c.Read(buf) // until the probe closes
			})
		}
	})
	return ln.Addr().String(), func() { ln.Close(); wg.Wait() }
}

// A tracker turns probe rounds into decisions: two successes make a proxy
// healthy, three failures unhealthy, and a proxy whose address cannot be
// read keeps its state until the grace period has passed.
func ExampleTracker() {
	address, stop := standIn()
	defer stop()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tr, err := health.NewTracker(&health.TrackerOptions{
		Rise: 2, Fall: 3, Grace: time.Minute,
		Now:      func() time.Time { return now },
		OnForget: func(s health.Status) { fmt.Println("forgot", s.ID) },
	})
	if err != nil {
		panic(err)
	}
	opts := &health.ProbeAllOptions{Target: "example.com:443"}
	round := func(proxies ...health.Proxy) {
		if _, err := tr.Round(context.Background(), proxies, opts); err != nil {
			panic(err)
		}
		if s, ok := tr.Get("proxy-a"); ok {
			fmt.Println(now.Format("15:04:05"), s.State)
		}
	}
	round(health.Proxy{ID: "proxy-a", Address: address})
	round(health.Proxy{ID: "proxy-a", Address: address})
	now = now.Add(30 * time.Second)
	round(health.Proxy{ID: "proxy-a"}) // address unknown for one round: still healthy
	now = now.Add(30 * time.Second)
	round() // grace has passed since it was last seen
	fmt.Println(len(tr.Snapshot()), "tracked")
	// Output:
	// 00:00:00 unknown
	// 00:00:00 healthy
	// 00:00:30 healthy
	// forgot proxy-a
	// 0 tracked
}

// Probe one proxy, here the in-process stand-in.
func ExampleProbe() {
	address, stop := standIn()
	defer stop()
	res := health.Probe(context.Background(), address, "example.com:443",
		&health.ProbeOptions{Timeout: 5 * time.Second})
	fmt.Println(res.OK, res.StatusCode, res.Kind, res.Total > 0)
	// Output: true 200 none true
}
