// Command delayproxy relays TCP connections from a local address to a
// target, adding round-trip time (package delayproxy). scripts/lab runs one
// per lab host, in front of the host's sshd.
//
//	delayproxy -target 10.251.1.2:22022 -rtt 50ms [-listen 127.0.0.1:0] [-addr-file F] [-rtt-file R] [-buffer BYTES] [-v]
//
// Once it listens it writes its address to -addr-file (when given), then
// relays until SIGTERM or SIGINT. With -rtt-file, SIGHUP reads a new
// round-trip time (e.g. "400ms") from that file and applies it to every
// relayed connection at once (`scripts/lab rtt N 400ms`); the proxy then
// writes what it applied (milliseconds) to R.applied.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr/funcr"

	"github.com/egressproxy/egressproxy/internal/testing/lab/delayproxy"
	"github.com/egressproxy/egressproxy/internal/testing/lab/labfile"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	target := flag.String("target", "", "address to relay to (required)")
	rtt := flag.Duration("rtt", 0, "round-trip time to add (each direction delays by half)")
	buffer := flag.Int("buffer", 0, "bytes buffered per direction of a connection (0: twice the 1 Gbit/s bandwidth-delay product)")
	addrFile := flag.String("addr-file", "", "file to write the listening address to")
	rttFile := flag.String("rtt-file", "", "file SIGHUP reads a new round-trip time from (the applied one goes to FILE.applied)")
	verbose := flag.Bool("v", false, "log every connection")
	flag.Parse()
	if flag.NArg() != 0 {
		fmt.Fprintf(os.Stderr, "delayproxy: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	v := 0
	if *verbose {
		v = 1
	}
	log := funcr.New(func(prefix, args string) { fmt.Fprintln(os.Stderr, prefix, args) }, funcr.Options{Verbosity: v})

	p, err := delayproxy.New(delayproxy.Config{Listen: *listen, Target: *target, RTT: *rtt, BufferBytes: *buffer, Logger: log})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if *addrFile != "" {
		if err := labfile.WriteAtomic(*addrFile, p.Addr().String()+"\n"); err != nil {
			fmt.Fprintf(os.Stderr, "delayproxy: %v\n", err)
			p.Close()
			os.Exit(1)
		}
	}
	log.Info("listening", "addr", p.Addr().String(), "target", *target, "rtt", rtt.String())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	for s := range sig {
		if s != syscall.SIGHUP {
			break
		}
		if *rttFile == "" {
			log.Info("SIGHUP ignored: no -rtt-file")
			continue
		}
		if err := applyRTT(p, *rttFile); err != nil {
			log.Error(err, "rtt not changed")
		}
	}
	if err := p.Close(); err != nil {
		log.Error(err, "close")
	}
}

// applyRTT sets p's round-trip time from the duration in file and writes
// what p applies now, in whole milliseconds, to file.applied.
func applyRTT(p *delayproxy.Proxy, file string) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	d, err := time.ParseDuration(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	if err := p.SetRTT(d); err != nil {
		return err
	}
	return labfile.WriteAtomic(file+".applied", strconv.FormatInt(p.RTT().Milliseconds(), 10)+"\n")
}
