package teststack

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// startTimeout bounds how long a daemon a test starts may take to be ready.
const startTimeout = 30 * time.Second

// SSHDOptions configure a second sshd started by a test (StartSSHD).
type SSHDOptions struct {
	// HostKey is the host private key file. Required.
	HostKey string
	// HostCertificate, when set, is a host certificate of HostKey
	// (ssh-keygen -s CA -h ...) that the sshd presents to clients offering
	// certificate algorithms. Zero: no certificate.
	HostCertificate string
	// AuthorizedKeys are authorized_keys lines, for every user. Required.
	AuthorizedKeys []string
}

// SSHD is an sshd a test started; it is stopped by the test's cleanup.
type SSHD struct {
	Addr string // 127.0.0.1:PORT
	Dir  string // where its config, pid file and authorized_keys live
	log  *lineWatch
}

// Log returns what the sshd logged so far (for failure messages).
func (s *SSHD) Log() string { return s.log.String() }

// StartSSHD starts a private sshd on a free 127.0.0.1 port, configured like
// the stack's own (key-only, UsePAM no, stream-local forwarding, so libvirt
// is reachable through it), in the foreground (-D) as a child of the test,
// and waits until it listens. t.Cleanup kills it and waits for it. It needs
// root and the stack's privilege separation directory, so it first Requires
// the stack.
func StartSSHD(t testing.TB, opts SSHDOptions) *SSHD {
	t.Helper()
	Require(t)
	bin, err := exec.LookPath("sshd")
	if err != nil {
		bin = "/usr/sbin/sshd"
	}
	if !filepath.IsAbs(bin) {
		if bin, err = filepath.Abs(bin); err != nil {
			t.Fatal(err)
		}
	}
	dir := t.TempDir()
	auth := filepath.Join(dir, "authorized_keys")
	if err := os.WriteFile(auth, []byte(strings.Join(opts.AuthorizedKeys, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	var conf strings.Builder
	fmt.Fprintf(&conf, `# a second sshd started by a test (internal/teststack.StartSSHD)
Port %d
ListenAddress 127.0.0.1
HostKey %s
`, port, opts.HostKey)
	if opts.HostCertificate != "" {
		fmt.Fprintf(&conf, "HostCertificate %s\n", opts.HostCertificate)
	}
	fmt.Fprintf(&conf, `PidFile %s
AuthorizedKeysFile %s
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
AllowStreamLocalForwarding yes
AllowTcpForwarding yes
# (sshd 9.2 denies direct-streamlocal channels too with "no")
X11Forwarding no
PrintMotd no
LogLevel VERBOSE
`, filepath.Join(dir, "sshd.pid"), auth)
	confPath := filepath.Join(dir, "sshd_config")
	if err := os.WriteFile(confPath, []byte(conf.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll("/run/sshd", 0o755); err != nil {
		t.Fatal(err)
	}
	s := &SSHD{Addr: fmt.Sprintf("127.0.0.1:%d", port), Dir: dir,
		log: newLineWatch(fmt.Sprintf("Server listening on 127.0.0.1 port %d", port))}
	cmd := exec.Command(bin, "-D", "-e", "-f", confPath)
	cmd.Stdout, cmd.Stderr = s.log, s.log
	startDaemon(t, cmd, s.log, "sshd")
	return s
}

// StartAgent starts a real ssh-agent in the foreground (-D) on a socket in a
// fresh temporary directory, adds keyFiles to it with ssh-add, and returns
// the socket path. t.Cleanup kills it and waits for it.
func StartAgent(t testing.TB, keyFiles ...string) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	w := newLineWatch("Agent pid")
	cmd := exec.Command("ssh-agent", "-D", "-a", sock)
	cmd.Stdout, cmd.Stderr = w, w
	startDaemon(t, cmd, w, "ssh-agent")
	for _, k := range keyFiles {
		ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
		add := exec.CommandContext(ctx, "ssh-add", k)
		add.Env = append(os.Environ(), "SSH_AUTH_SOCK="+sock)
		out, err := add.CombinedOutput()
		cancel()
		if err != nil {
			t.Fatalf("teststack: ssh-add %s: %v\n%s", k, err, out)
		}
	}
	return sock
}

// AgentConnections returns how many client connections the ssh-agent
// listening on sock has open: the unix sockets of the network namespace
// bound to sock, minus the listening one (accepted sockets carry the path).
func AgentConnections(t testing.TB, sock string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		t.Fatalf("teststack: %v", err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 8 && f[len(f)-1] == sock {
			n++
		}
	}
	return n - 1
}

// Keygen runs ssh-keygen with args (quietly, no prompt) and fails the test
// on error.
func Keygen(t testing.TB, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ssh-keygen", append([]string{"-q"}, args...)...)
	cmd.Stdin = nil
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("teststack: ssh-keygen %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// startDaemon starts cmd, waits until w has seen its ready line (or the
// daemon exited, or startTimeout passed), and registers its kill and wait.
func startDaemon(t testing.TB, cmd *exec.Cmd, w *lineWatch, name string) {
	t.Helper()
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("teststack: start %s: %v", name, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Kill()
		<-exited
	}
	select {
	case <-w.ready:
		t.Cleanup(stop)
	case err := <-exited:
		exited <- err
		t.Fatalf("teststack: %s exited before it was ready: %v\n%s", name, err, w)
	case <-time.After(startTimeout):
		stop()
		t.Fatalf("teststack: %s not ready after %v\n%s", name, startTimeout, w)
	}
}

// freePort returns a TCP port of 127.0.0.1 that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// lineWatch collects a daemon's output and closes ready when a line
// containing want has been written.
type lineWatch struct {
	want  string
	ready chan struct{}
	mu    sync.Mutex
	buf   bytes.Buffer
	seen  bool
}

func newLineWatch(want string) *lineWatch {
	return &lineWatch{want: want, ready: make(chan struct{})}
}

func (w *lineWatch) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(b)
	if !w.seen {
		sc := bufio.NewScanner(bytes.NewReader(w.buf.Bytes()))
		for sc.Scan() {
			if strings.Contains(sc.Text(), w.want) {
				w.seen = true
				close(w.ready)
				break
			}
		}
	}
	return len(b), nil
}

func (w *lineWatch) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

var _ io.Writer = (*lineWatch)(nil)
