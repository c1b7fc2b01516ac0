//go:build integration

package teststack

import (
	"bufio"
	"encoding/base64"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

const dialTimeout = 10 * time.Second

// TestStackIsThere checks that the stack the environment describes is really
// running, piece by piece.
func TestStackIsThere(t *testing.T) {
	env := Require(t)

	t.Run("files", func(t *testing.T) {
		for _, tc := range []struct {
			name, path string
			wantMode   fs.FileMode // type bits that must be set; 0 = regular file
		}{
			{"ssh key", env.SSHKey, 0},
			{"known_hosts", env.KnownHosts, 0},
			{"script", env.Script, 0},
			{"libvirt socket", env.LibvirtSocket, fs.ModeSocket},
			{"pool dir", env.PoolPath, fs.ModeDir},
		} {
			t.Run(tc.name, func(t *testing.T) {
				fi, err := os.Stat(tc.path)
				if err != nil {
					t.Fatalf("%s: %v", tc.name, err)
				}
				if got := fi.Mode().Type(); got != tc.wantMode {
					t.Errorf("%s %s: type %v, want %v", tc.name, tc.path, got, tc.wantMode)
				}
			})
		}
		kh, err := os.ReadFile(env.KnownHosts)
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(env.SSHAddr)
		if want := "[127.0.0.1]:" + port + " "; !strings.HasPrefix(string(kh), want) {
			t.Errorf("known_hosts %q does not pin %q", kh, want)
		}
	})

	t.Run("tcp", func(t *testing.T) {
		for _, tc := range []struct{ name, addr string }{
			{"sshd", env.SSHAddr},
			{"squid", env.SquidAddr},
			{"squid auth", env.SquidAuthAddr},
		} {
			t.Run(tc.name, func(t *testing.T) {
				c, err := net.DialTimeout("tcp", tc.addr, dialTimeout)
				if err != nil {
					t.Fatalf("%s at %s: %v", tc.name, tc.addr, err)
				}
				c.Close()
			})
		}
	})

	t.Run("ssh", func(t *testing.T) {
		for _, tc := range []struct {
			user       string
			socketOpen bool
		}{
			{env.SSHUser, true},
			{env.UnprivUser, false},
		} {
			t.Run(tc.user, func(t *testing.T) {
				client := dialSSH(t, env, tc.user)
				c, err := client.Dial("unix", env.LibvirtSocket)
				if err == nil {
					c.Close()
				}
				if got := err == nil; got != tc.socketOpen {
					t.Errorf("user %s opening %s: err %v, want open=%v", tc.user, env.LibvirtSocket, err, tc.socketOpen)
				}
			})
		}
	})

	t.Run("squid", func(t *testing.T) {
		target := startTarget(t)
		_, targetPort, _ := net.SplitHostPort(target)
		creds := env.SquidUser + ":" + env.SquidPassword
		for _, tc := range []struct {
			name, proxy, target, creds string
			want                       int
		}{
			{"open port", env.SquidAddr, target, "", http.StatusOK},
			{"auth port with creds", env.SquidAuthAddr, target, creds, http.StatusOK},
			{"auth port without creds", env.SquidAuthAddr, target, "", http.StatusProxyAuthRequired},
			{"auth port wrong password", env.SquidAuthAddr, target, env.SquidUser + ":x" + env.SquidPassword, http.StatusProxyAuthRequired},
			{"denied port", env.SquidAddr, "127.0.0.1:" + strconv.Itoa(env.SquidDeniedPort), "", http.StatusForbidden},
			{"other host", env.SquidAddr, "127.0.0.2:" + targetPort, "", http.StatusForbidden},
		} {
			t.Run(tc.name, func(t *testing.T) {
				if got := connectStatus(t, tc.proxy, tc.target, tc.creds); got != tc.want {
					t.Errorf("CONNECT %s via %s: status %d, want %d", tc.target, tc.proxy, got, tc.want)
				}
			})
		}
	})
}

// TestSSHDStopStart checks the script's sshd-stop/sshd-start through Run.
func TestSSHDStopStart(t *testing.T) {
	env := Require(t)
	before := Run(t, "sshd-pid")
	if _, err := strconv.Atoi(before); err != nil {
		t.Fatalf("sshd-pid printed %q, want a pid", before)
	}
	Run(t, "sshd-stop")
	t.Cleanup(func() { Run(t, "sshd-start") })
	if c, err := net.DialTimeout("tcp", env.SSHAddr, dialTimeout); err == nil {
		c.Close()
		t.Fatalf("sshd still accepts connections at %s after sshd-stop", env.SSHAddr)
	}
	Run(t, "sshd-start")
	after := Run(t, "sshd-pid")
	if after == before {
		t.Errorf("sshd pid unchanged (%s) across stop/start", after)
	}
	dialSSH(t, env, env.SSHUser)
}

// TestLibvirtdRestart checks libvirtd-restart: a new daemon serving the socket.
func TestLibvirtdRestart(t *testing.T) {
	env := Require(t)
	before := Run(t, "libvirtd-pid")
	Run(t, "libvirtd-restart")
	after := Run(t, "libvirtd-pid")
	if after == before {
		t.Errorf("libvirtd pid unchanged (%s) across libvirtd-restart", after)
	}
	c, err := net.DialTimeout("unix", env.LibvirtSocket, dialTimeout)
	if err != nil {
		t.Fatalf("libvirt socket after restart: %v", err)
	}
	c.Close()
}

func dialSSH(t *testing.T, env Env, user string) *ssh.Client {
	t.Helper()
	keyPEM, err := os.ReadFile(env.SSHKey)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.ParsePrivateKey(keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	hostKeys, err := knownhosts.New(env.KnownHosts)
	if err != nil {
		t.Fatal(err)
	}
	client, err := ssh.Dial("tcp", env.SSHAddr, &ssh.ClientConfig{
		User:            user,
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback: hostKeys,
		Timeout:         dialTimeout,
	})
	if err != nil {
		t.Fatalf("ssh %s@%s: %v", user, env.SSHAddr, err)
	}
	t.Cleanup(func() { client.Close() })
	return client
}

// startTarget serves TCP on loopback (accept and close) and returns its address.
func startTarget(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
	})
	return ln.Addr().String()
}

// connectStatus sends a CONNECT for target through proxy and returns the
// status code of the answer.
func connectStatus(t *testing.T, proxy, target, creds string) int {
	t.Helper()
	c, err := net.DialTimeout("tcp", proxy, dialTimeout)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	req := fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: %s\r\n", target, target)
	if creds != "" {
		req += "Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(creds)) + "\r\n"
	}
	if _, err := c.Write([]byte(req + "\r\n")); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("reading the answer to CONNECT %s via %s: %v", target, proxy, err)
	}
	resp.Body.Close()
	return resp.StatusCode
}
