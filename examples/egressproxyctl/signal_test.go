package main

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
)

// buildBinary builds the command into a temporary directory.
func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "egressproxyctl")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// exitStatus returns the exit code of a finished command.
func exitStatus(t *testing.T, err error) int {
	t.Helper()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.ExitCode()
	}
	t.Fatalf("run: %v", err)
	return -1
}

// Ctrl-C on the real binary: `check` against a host whose sshd accepts the
// TCP connection and then never speaks (the SSH handshake hangs until its
// 10 s dial timeout) ends promptly after SIGINT, with exit code 130 and
// "canceled" on stderr.
func TestBinaryInterrupt(t *testing.T) {
	bin := buildBinary(t)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	defer func() {
		ln.Close()
		for c := range accepted {
			c.Close()
		}
	}()

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
	addr := ln.Addr().String()
	_, port, _ := net.SplitHostPort(addr)
	for path, body := range map[string]string{
		keyFile: string(pem.EncodeToMemory(block)),
		khFile:  fmt.Sprintf("[127.0.0.1]:%s %s", port, ssh.MarshalAuthorizedKey(signer.PublicKey())),
		cfgFile: fmt.Sprintf("entries:\n  - entry: silent\n    owner: tests\n    address: %s\n    user: root\n    keyFile: %s\n    knownHostsFile: %s\n    pool: default\n    domainType: qemu\n", addr, keyFile, khFile),
	} {
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	cmd := exec.Command(bin, "--config", cfgFile, "check")
	var stdout, stderr syncBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case c := <-accepted: // the SSH dial is in flight
		defer c.Close()
	case err := <-done:
		t.Fatalf("check ended before dialing: %v\nstdout: %s\nstderr: %s", err, stdout.String(), stderr.String())
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		<-done
		t.Fatal("check never dialed the host")
	}
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	var waitErr error
	select {
	case waitErr = <-done:
	case <-time.After(8 * time.Second): // the dial timeout is 10 s: only the interrupt can end it sooner
		cmd.Process.Kill()
		<-done
		t.Fatalf("still running 8s after SIGINT\nstderr: %s", stderr.String())
	}
	elapsed := time.Since(start)
	code := exitStatus(t, waitErr)
	t.Logf("exit %d %s after SIGINT; stderr: %s", code, elapsed.Round(time.Millisecond), stderr.String())
	if code != exitCanceled || !strings.Contains(stderr.String(), "canceled") {
		t.Fatalf("exit %d, stderr %q; want %d and \"canceled\"", code, stderr.String(), exitCanceled)
	}
}
