package sshconn

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
)

// TestErrorTextBounded: sshconn's errors are valid UTF-8 and at most
// errs.MaxErrorText bytes, whatever the input (here a 1 MiB address
// with invalid UTF-8 in it, through New's validation).
func TestErrorTextBounded(t *testing.T) {
	t.Parallel()
	addr := strings.Repeat("h\xff", 1<<19) + ":22"
	_, err := New(Config{Address: addr, User: strings.Repeat("u", 1<<20)}, nil)
	if err == nil {
		t.Fatal("no error")
	}
	s := err.Error()
	if len(s) > errs.MaxErrorText || !utf8.ValidString(s) {
		t.Errorf("error of %d bytes (valid UTF-8 %v), want at most %d", len(s), utf8.ValidString(s), errs.MaxErrorText)
	}
	if errKind(err) != KindConfig || len(errs.FieldErrors(err)) == 0 {
		t.Errorf("kind %v, %d field errors", errKind(err), len(errs.FieldErrors(err)))
	}
}

// regexpBackoff matches the wait a backing-off error states.
var regexpBackoff = regexp.MustCompile(`backing off [0-9hms.]+ before`)

// closedPort returns a loopback address nobody listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := ln.Addr().String()
	_ = ln.Close()
	return a
}

// The texts of the failures a person reads most, pinned: each says the
// address once, as the subject, and a file as a file, with the step that
// failed and its kind.
func TestErrorTexts(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	dir := f.dir
	sock := sshtest.UnixSocket(t)
	f.srv.Refuse(sock)
	addr := f.srv.Addr
	closed := closedPort(t)
	ctx := context.Background()
	client := func(edit func(*Config)) error {
		cfg := f.config()
		edit(&cfg)
		_, err := newPool(t, cfg).Client(ctx)
		return err
	}
	tests := []struct {
		name string
		err  func() error
		want string
	}{
		{"connection refused", func() error {
			return client(func(c *Config) {
				c.Address = closed
				c.KnownHostsFile = sshtest.WriteKnownHosts(t, dir, "kh-closed", closed, f.srv.HostKeys[0].PublicKey())
			})
		}, "sshconn " + closed + ": dial: unreachable: connect: connection refused"},
		{"key file missing", func() error {
			return client(func(c *Config) { c.KeyFile = filepath.Join(dir, "nokey") })
		}, "sshconn " + addr + ": read key file: key unreadable: open " + filepath.Join(dir, "nokey") + ": no such file or directory"},
		{"key file not a key", func() error {
			p := filepath.Join(dir, "garbage")
			if err := os.WriteFile(p, []byte("not a key"), 0o600); err != nil {
				t.Fatal(err)
			}
			return client(func(c *Config) { c.KeyFile = p })
		}, "sshconn " + addr + ": parse key: key unreadable: key file " + filepath.Join(dir, "garbage") + ": ssh: no key found"},
		{"known_hosts missing", func() error {
			return client(func(c *Config) { c.KnownHostsFile = filepath.Join(dir, "nokh") })
		}, "sshconn " + addr + ": read known_hosts: host unknown: open " + filepath.Join(dir, "nokh") + ": no such file or directory"},
		{"forbidden", func() error {
			p := newPool(t, f.config())
			c, err := p.Client(ctx)
			if err != nil {
				t.Fatal(err)
			}
			_, err = p.DialUnix(ctx, c, sock)
			return err
		}, "sshconn " + addr + ": open unix socket " + sock + ": forbidden (the user may not open the socket, or the daemon behind it is not running): ssh: rejected: connect failed (\"open failed\")"},
		{"backing off", func() error {
			cfg := f.config()
			cfg.Address = closed
			cfg.KnownHostsFile = sshtest.WriteKnownHosts(t, dir, "kh-closed2", closed, f.srv.HostKeys[0].PublicKey())
			cfg.MaxRedialBackoff = time.Hour
			p := newPool(t, cfg)
			p.mu.Lock()
			p.failures = 30 // the next failed dial backs off MaxRedialBackoff
			p.mu.Unlock()
			if _, err := p.Client(ctx); err == nil {
				t.Fatal("dial to a closed port succeeded")
			}
			qctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			_, err := p.Client(qctx)
			return err
		}, "sshconn " + closed + ": dial (failed; backing off 1h0m0s before the next dial): unreachable: connect: connection refused"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.err()
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("err %v, want an *Error", err)
			}
			got := err.Error()
			if tc.name == "backing off" { // the wait left is not fixed
				got = regexpBackoff.ReplaceAllString(got, "backing off 1h0m0s before")
			}
			if got != tc.want {
				t.Errorf("text\n%s\nwant\n%s", err, tc.want)
			}
			if n := strings.Count(err.Error(), e.Address); e.Address != "" && n != 1 {
				t.Errorf("the address is said %d times: %s", n, err)
			}
		})
	}
}
