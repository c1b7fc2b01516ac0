package teststack

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Env describes the running stack. Every field is set when Require returns.
type Env struct {
	Dir           string // EGRESSPROXY_STACK_DIR: scratch dir of the stack
	Script        string // EGRESSPROXY_TESTSTACK: absolute path of scripts/teststack
	SSHAddr       string // EGRESSPROXY_SSH_ADDR: 127.0.0.1:PORT of the stack's sshd
	SSHUser       string // EGRESSPROXY_SSH_USER: root
	UnprivUser    string // EGRESSPROXY_SSH_UNPRIV_USER: same key, cannot open the libvirt socket
	SSHKey        string // EGRESSPROXY_SSH_KEY: authorized client private key file
	KnownHosts    string // EGRESSPROXY_KNOWN_HOSTS: pins the host key as [127.0.0.1]:PORT
	LibvirtSocket string // EGRESSPROXY_LIBVIRT_SOCKET: libvirtd's read-write socket (root only)
	LibvirtURI    string // EGRESSPROXY_LIBVIRT_URI: qemu:///system
	Pool          string // EGRESSPROXY_POOL: an active dir storage pool
	PoolPath      string // EGRESSPROXY_POOL_PATH: that pool's directory
	SquidAddr     string // EGRESSPROXY_SQUID_ADDR: CONNECT without auth
	SquidAuthAddr string // EGRESSPROXY_SQUID_AUTH_ADDR: CONNECT with basic proxy auth
	SquidUser     string // EGRESSPROXY_SQUID_USER: valid on SquidAuthAddr
	SquidPassword string // EGRESSPROXY_SQUID_PASSWORD: valid on SquidAuthAddr

	// SquidDeniedPort is a port squid refuses to CONNECT to (403 Forbidden);
	// CONNECT to every other port of 127.0.0.1 is allowed.
	SquidDeniedPort int // EGRESSPROXY_SQUID_DENIED_PORT
}

// Names of the environment variables `scripts/teststack env` prints.
const (
	VarDir             = "EGRESSPROXY_STACK_DIR"
	VarScript          = "EGRESSPROXY_TESTSTACK"
	VarSSHAddr         = "EGRESSPROXY_SSH_ADDR"
	VarSSHUser         = "EGRESSPROXY_SSH_USER"
	VarUnprivUser      = "EGRESSPROXY_SSH_UNPRIV_USER"
	VarSSHKey          = "EGRESSPROXY_SSH_KEY"
	VarKnownHosts      = "EGRESSPROXY_KNOWN_HOSTS"
	VarLibvirtSocket   = "EGRESSPROXY_LIBVIRT_SOCKET"
	VarLibvirtURI      = "EGRESSPROXY_LIBVIRT_URI"
	VarPool            = "EGRESSPROXY_POOL"
	VarPoolPath        = "EGRESSPROXY_POOL_PATH"
	VarSquidAddr       = "EGRESSPROXY_SQUID_ADDR"
	VarSquidAuthAddr   = "EGRESSPROXY_SQUID_AUTH_ADDR"
	VarSquidUser       = "EGRESSPROXY_SQUID_USER"
	VarSquidPassword   = "EGRESSPROXY_SQUID_PASSWORD"
	VarSquidDeniedPort = "EGRESSPROXY_SQUID_DENIED_PORT"
)

// runTimeout bounds one run of the script (sshd-start, libvirtd-restart...).
const runTimeout = 2 * time.Minute

// InCI reports whether the tests run in CI (CI=true), where a missing stack
// is a failure rather than a reason to skip.
func InCI() bool { return os.Getenv("CI") == "true" }

// Require returns the running stack's Env. Without the stack's environment
// (EGRESSPROXY_SSH_ADDR unset) it fails the test when InCI, and skips it
// otherwise. A partial or malformed environment always fails the test.
func Require(t testing.TB) Env {
	t.Helper()
	if os.Getenv(VarSSHAddr) == "" {
		const how = "run `make test` (it starts the stack), or `scripts/teststack up` and then `eval \"$(scripts/teststack env)\"`"
		if InCI() {
			t.Fatalf("teststack: the real test stack is required in CI (CI=true) but %s is unset; %s", VarSSHAddr, how)
		}
		t.Skipf("teststack: real test stack not available (%s unset); %s", VarSSHAddr, how)
	}
	env, err := fromEnv(os.Getenv)
	if err != nil {
		t.Fatalf("teststack: %v", err)
	}
	return env
}

// fromEnv builds an Env from getenv, naming every missing or bad variable.
func fromEnv(getenv func(string) string) (Env, error) {
	var missing []string
	str := func(k string) string {
		v := getenv(k)
		if v == "" {
			missing = append(missing, k)
		}
		return v
	}
	env := Env{
		Dir:           str(VarDir),
		Script:        str(VarScript),
		SSHAddr:       str(VarSSHAddr),
		SSHUser:       str(VarSSHUser),
		UnprivUser:    str(VarUnprivUser),
		SSHKey:        str(VarSSHKey),
		KnownHosts:    str(VarKnownHosts),
		LibvirtSocket: str(VarLibvirtSocket),
		LibvirtURI:    str(VarLibvirtURI),
		Pool:          str(VarPool),
		PoolPath:      str(VarPoolPath),
		SquidAddr:     str(VarSquidAddr),
		SquidAuthAddr: str(VarSquidAuthAddr),
		SquidUser:     str(VarSquidUser),
		SquidPassword: str(VarSquidPassword),
	}
	port := str(VarSquidDeniedPort)
	if len(missing) > 0 {
		return Env{}, fmt.Errorf("incomplete stack environment, unset: %s (load all of `scripts/teststack env`)", strings.Join(missing, ", "))
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return Env{}, fmt.Errorf("%s=%q: must be a TCP port number 1-65535", VarSquidDeniedPort, port)
	}
	env.SquidDeniedPort = p
	return env, nil
}

// Run runs scripts/teststack with args (a subcommand such as "sshd-stop",
// "sshd-start", "sshd-pid", "libvirtd-restart", "libvirtd-pid") and returns
// its standard output without surrounding space. It fails the test if the
// script fails, and skips or fails like Require when there is no stack.
func Run(t testing.TB, args ...string) string {
	t.Helper()
	env := Require(t)
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, env.Script, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// The script starts daemons; should one keep our pipes open, do not wait
	// for it forever.
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		t.Fatalf("teststack: %s %s: %v\nstdout:\n%s\nstderr:\n%s",
			env.Script, strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return strings.TrimSpace(stdout.String())
}
