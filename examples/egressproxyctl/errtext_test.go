package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"
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
	_, port, _ := net.SplitHostPort(addr)

	dir := t.TempDir()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(key, "")
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(key)
	if err != nil {
		t.Fatal(err)
	}
	keyFile, khFile, cfgFile := filepath.Join(dir, "id"), filepath.Join(dir, "known_hosts"), filepath.Join(dir, "ctl.yaml")
	for path, body := range map[string]string{
		keyFile: string(pem.EncodeToMemory(block)),
		khFile:  fmt.Sprintf("[127.0.0.1]:%s %s", port, ssh.MarshalAuthorizedKey(signer.PublicKey())),
		cfgFile: fmt.Sprintf("entries:\n  - entry: lab1\n    owner: tests\n    address: %s\n    user: root\n    keyFile: %s\n    knownHostsFile: %s\n    pool: default\n    domainType: qemu\n    images:\n      base:\n        url: http://127.0.0.1:9/base.qcow2\n", addr, keyFile, khFile),
	} {
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
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
