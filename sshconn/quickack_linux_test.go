package sshconn

import (
	"io"
	"net"
	"slices"
	"testing"
	"time"
)

// nagleGaps measures, over rounds request/answer exchanges on a loopback
// TCP connection, how long the second of two small packets the server
// writes back to back arrives after the first. The server leaves Nagle's
// algorithm on, as OpenSSH's sshd does for connections without a
// terminal; the client reads through an activityConn, with its quick
// acknowledgements on or off.
func nagleGaps(t *testing.T, quick bool, rounds int) []time.Duration {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
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
		_ = c.(*net.TCPConn).SetNoDelay(false)
		req := make([]byte, 8)
		for {
			if _, err := io.ReadFull(c, req); err != nil {
				return
			}
			// a window adjustment, then the answer
			if _, err := c.Write(make([]byte, 40)); err != nil {
				return
			}
			if _, err := c.Write(make([]byte, 80)); err != nil {
				return
			}
		}
	}()
	nc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c := newActivityConn(nc)
	if c.quickAck == nil {
		t.Fatal("no quick acknowledgement on a TCP connection")
	}
	if !quick {
		c.quickAck = nil
	}
	defer func() { _ = c.Close(); <-done }()
	var gaps []time.Duration
	adjust, answer := make([]byte, 40), make([]byte, 80)
	for range rounds {
		if _, err := c.Write(make([]byte, 8)); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, adjust); err != nil {
			t.Fatal(err)
		}
		first := time.Now()
		if _, err := io.ReadFull(c, answer); err != nil {
			t.Fatal(err)
		}
		gaps = append(gaps, time.Since(first))
	}
	return gaps
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// TestQuickAckAfterSmallReads: a small packet held back by the peer's
// Nagle algorithm behind an earlier small one arrives at once when the
// earlier one was read through an activityConn (its acknowledgement is
// sent at once), not after Linux's delayed-acknowledgement timer (40 ms).
func TestQuickAckAfterSmallReads(t *testing.T) {
	const rounds = 15
	without := median(nagleGaps(t, false, rounds))
	with := median(nagleGaps(t, true, rounds))
	t.Logf("median gap between two small packets from a Nagle peer: %v without quick acks, %v with", without, with)
	if with > 20*time.Millisecond {
		t.Errorf("with quick acknowledgements the second packet came %v after the first (median), want < 20ms", with)
	}
	if without < 30*time.Millisecond {
		t.Logf("this kernel did not delay the acknowledgement without TCP_QUICKACK (median %v): the test shows nothing here", without)
	}
}
