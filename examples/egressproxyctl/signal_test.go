package main

import (
	"errors"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
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

	cfgFile := writeKVM2Config(t, ln.Addr().String(), "silent", "")

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
