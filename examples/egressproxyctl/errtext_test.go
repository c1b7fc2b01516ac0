package main

import (
	"context"
	"net"
	"strings"
	"testing"
)

// A command that fails on a real kvm2 entry says the entry, the address and
// the step once each, and never labels its step with another command's
// operation (delete and probe look the instance up with a List; their
// errors say so, not "egressproxy list").
func TestErrorTextsSayEachThingOnce(t *testing.T) {
	// An address nothing listens on: the dial is refused at once.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	cfgFile := writeKVM2Config(t, addr, "lab1", "    images:\n      base:\n        url: http://127.0.0.1:9/base.qcow2\n")
	for _, args := range [][]string{
		{"ls"},
		{"delete", "foo"},
		{"probe", "foo", "--target", "127.0.0.1:9"},
		{"create", "foo", "--uid", "u-foo"},
	} {
		var out, errb syncBuffer
		e := &env{stdout: &out, stderr: &errb, getenv: func(string) string { return "" }, open: openKVM2}
		code := run(context.Background(), append([]string{"--config", cfgFile}, args...), e)
		msg := errb.String()
		if code == exitOK || msg == "" {
			t.Errorf("%v: exit %d, stderr %q; want a failure", args, code, msg)
			continue
		}
		if n := strings.Count(msg, "lab1"); n != 1 {
			t.Errorf("%v: the entry said %d times: %q", args, n, msg)
		}
		if n := strings.Count(msg, addr); n != 1 {
			t.Errorf("%v: the address said %d times: %q", args, n, msg)
		}
		if args[0] != "ls" && strings.Contains(msg, "egressproxy list") {
			t.Errorf("%v: labelled as a list: %q", args, msg)
		}
		t.Logf("%v: %s", args, strings.TrimSpace(msg))
	}
}
