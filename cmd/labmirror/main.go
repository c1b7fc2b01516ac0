// Command labmirror is the lab's image mirror: an HTTP file server for one
// directory (http.FileServer: Content-Length, Last-Modified, byte ranges),
// which counts what it serves. `scripts/lab mirror up` runs it in a network
// namespace of its own behind a shaped link (docs/lab.md), so that the
// fan-out benchmark and tests download through a rate-limited mirror, as
// from a registry or an object store with egress limits.
//
//	labmirror -dir DIR [-listen 10.251.0.2:8080] [-addr-file F]
//
// GET /.stats answers JSON {"requests": N, "bytes": B}: the requests for
// files and the body bytes written to them since the start (or since the
// last POST /.stats/reset). Once it listens it writes its address to
// -addr-file (when given); it serves until SIGTERM or SIGINT.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/lab/labfile"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	dir := flag.String("dir", "", "directory to serve (required)")
	addrFile := flag.String("addr-file", "", "file to write the listening address to")
	flag.Parse()
	if flag.NArg() != 0 || *dir == "" {
		fmt.Fprintln(os.Stderr, "usage: labmirror -dir DIR [-listen ADDR] [-addr-file F]")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "labmirror: %v\n", err)
		os.Exit(1)
	}
	var st stats
	files := http.FileServer(http.Dir(*dir))
	mux := http.NewServeMux()
	mux.HandleFunc("GET /.stats", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]int64{"requests": st.requests.Load(), "bytes": st.bytes.Load()})
	})
	mux.HandleFunc("POST /.stats/reset", func(w http.ResponseWriter, r *http.Request) {
		st.requests.Store(0)
		st.bytes.Store(0)
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		st.requests.Add(1)
		files.ServeHTTP(&counting{ResponseWriter: w, n: &st.bytes}, r)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if *addrFile != "" {
		if err := labfile.WriteAtomic(*addrFile, ln.Addr().String()+"\n"); err != nil {
			fmt.Fprintf(os.Stderr, "labmirror: %v\n", err)
			os.Exit(1)
		}
	}
	fmt.Fprintf(os.Stderr, "labmirror: serving %s on %s\n", *dir, ln.Addr())
	done := make(chan struct{})
	go func() {
		defer close(done)
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}()
	if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
		fmt.Fprintf(os.Stderr, "labmirror: %v\n", err)
		os.Exit(1)
	}
	<-done
}

type stats struct{ requests, bytes atomic.Int64 }

// counting counts the body bytes written through it.
type counting struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (c *counting) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.n.Add(int64(n))
	return n, err
}
