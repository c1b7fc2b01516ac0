//go:build integration

package operator_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/examples/operator/internal/kustomized"
	"github.com/egressproxy/egressproxy/examples/operator/internal/ociimage"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
)

// operatorUser is the apiserver user the operator's processes run as: it
// has exactly the ClusterRole of config/rbac (the README's RBAC table), so
// a permission the code needs and the role lacks shows up as a Forbidden
// error in the operator's log.
const operatorUser = "egressproxy-operator"

// buildOperator builds cmd/egressproxy-operator into a temporary directory
// as the image has it (ociimage.BuildBinary: static, reproducible), from
// the build cache the test's own build filled (no download: the module's
// dependencies are the test's; make operator-test builds everything with
// the image's CGO_ENABLED and -trimpath, so nothing is compiled twice).
func buildOperator(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "egressproxy-operator")
	t0 := time.Now()
	if err := ociimage.BuildBinary(context.Background(), ".", bin); err != nil {
		t.Fatal(err)
	}
	t.Logf("built the operator command in %v", time.Since(t0).Round(100*time.Millisecond))
	return bin
}

// deployObjects are config/default's objects, as kubectl kustomize renders
// them.
func deployObjects(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	objs, err := kustomized.Render(filepath.Join("config", "default"))
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// freeLoopbackAddr is a loopback address with a port nothing listens on
// now, for a process to listen on.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// operatorKubeconfig applies the operator's ClusterRole (config/rbac),
// binds it to operatorUser and returns a kubeconfig file of that user.
func operatorKubeconfig(t *testing.T, ctx context.Context, env *envtest.Environment, c client.Client) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("config", "rbac", "role.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var role rbacv1.ClusterRole
	if err := yaml.UnmarshalStrict(data, &role); err != nil {
		t.Fatalf("config/rbac/role.yaml: %v", err)
	}
	if err := c.Create(ctx, &role); err != nil {
		t.Fatalf("create the ClusterRole: %v", err)
	}
	if err := c.Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role.Name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: operatorUser}},
	}); err != nil {
		t.Fatalf("create the ClusterRoleBinding: %v", err)
	}
	u, err := env.AddUser(envtest.User{Name: operatorUser}, nil)
	if err != nil {
		t.Fatalf("add user %s: %v", operatorUser, err)
	}
	kc, err := u.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kc, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// operatorProcess is one replica of the operator: the command, run as an
// OS process of its own.
type operatorProcess struct {
	name string
	// metrics and probes are where it serves /metrics and /healthz,
	// /readyz.
	metrics, probes string
	cmd             *exec.Cmd
	log             string        // its stdout and stderr
	exited          chan struct{} // closed when Wait returned
	err             error         // Wait's result, once exited is closed
}

// startOperatorProcess starts bin with args; its output goes to a file in
// logDir. Unless the test ended it, the test's cleanup stops it (SIGTERM,
// then SIGKILL after a minute).
func startOperatorProcess(t *testing.T, bin, name, logDir string, args []string) *operatorProcess {
	t.Helper()
	p := &operatorProcess{name: name, log: filepath.Join(logDir, name+".log"), exited: make(chan struct{})}
	f, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	if err := p.cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		f.Close()
		close(p.exited)
	}()
	t.Logf("%s: started, pid %d", name, p.cmd.Process.Pid)
	t.Cleanup(func() {
		select {
		case <-p.exited:
			return
		default:
		}
		if err := p.terminate(time.Minute); err != nil {
			t.Errorf("%s at the end of the test: %v", name, err)
		}
	})
	return p
}

// kill sends SIGKILL: the process ends at once, whatever it was doing; it
// releases nothing (its Lease, its image cache claims, its libvirt
// streams stay as they were).
func (p *operatorProcess) kill(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("kill %s: %v", p.name, err)
	}
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not end within 30 s of SIGKILL", p.name)
	}
	var ee *exec.ExitError
	if !errors.As(p.err, &ee) {
		t.Fatalf("%s after SIGKILL: Wait says %v", p.name, p.err)
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("%s ended with %v, not by SIGKILL (it ended on its own before the kill)", p.name, p.err)
	}
}

// terminate sends SIGTERM (a graceful stop: the manager ends its
// reconciles and releases its Lease) and waits up to d for the exit; the
// error is the process's own failure (exit status), or that it did not
// stop (it is then killed).
func (p *operatorProcess) terminate(d time.Duration) error {
	select {
	case <-p.exited:
		return p.err
	default:
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return err
	}
	select {
	case <-p.exited:
		return p.err
	case <-time.After(d):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("did not stop within %v of SIGTERM; killed", d)
	}
}

// waitEndpoints waits until p answers its liveness and readiness probes
// (200 on /healthz and /readyz, as the Deployment's probes ask) and serves
// controller-runtime's metrics registry (which counts the process's
// apiserver requests: made by then, since readiness waits for the caches).
func (p *operatorProcess) waitEndpoints(t *testing.T) {
	t.Helper()
	get := func(url string) (string, error) {
		resp, err := http.Get(url)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("%s: %s: %s", url, resp.Status, b)
		}
		return string(b), err
	}
	eventually.NoError(t, 2*time.Minute, func() error {
		for _, path := range []string{"/healthz", "/readyz"} {
			if _, err := get("http://" + p.probes + path); err != nil {
				return err
			}
		}
		body, err := get("http://" + p.metrics + "/metrics")
		if err == nil && !strings.Contains(body, "rest_client_requests_total") {
			err = errors.New("/metrics does not count the process's apiserver requests (rest_client_requests_total)")
		}
		return err
	}, "%s's health endpoints and metrics", p.name)
}

// grep returns the lines of p's log that contain sub (case-insensitive).
func (p *operatorProcess) grep(sub string) []string {
	f, err := os.Open(p.log)
	if err != nil {
		return []string{err.Error()}
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	sub = strings.ToLower(sub)
	for sc.Scan() {
		if strings.Contains(strings.ToLower(sc.Text()), sub) {
			out = append(out, sc.Text())
		}
	}
	return out
}

// tail returns the last n lines of p's log.
func (p *operatorProcess) tail(n int) string {
	b, err := os.ReadFile(p.log)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// leaseHolder reads the operator's leader election Lease: its holder ("":
// released or never held) and duration.
func leaseHolder(ctx context.Context, c client.Client) (holder string, dur time.Duration, transitions int32, err error) {
	var l coordinationv1.Lease
	if err := c.Get(ctx, client.ObjectKey{Namespace: operatorNS, Name: controller.LeaderElectionID}, &l); err != nil {
		return "", 0, 0, err
	}
	if l.Spec.HolderIdentity != nil {
		holder = *l.Spec.HolderIdentity
	}
	if l.Spec.LeaseDurationSeconds != nil {
		dur = time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
	}
	if l.Spec.LeaseTransitions != nil {
		transitions = *l.Spec.LeaseTransitions
	}
	return holder, dur, transitions, nil
}

// heldImage is an image mirror the test holds: every GET gets the first
// half of the image at once and the rest only after release, so a cold
// fetch of it stays in flight (its claim taken, its bytes streaming to the
// host) for as long as the test wants.
type heldImage struct {
	url, sha256 string
	started     chan int // the number of each GET, once its first half is written
	release     chan struct{}
	once        sync.Once
	n           atomic.Int32
}

func serveHeldImage(t *testing.T, img []byte, name string) *heldImage {
	t.Helper()
	sum := sha256.Sum256(img)
	h := &heldImage{sha256: hex.EncodeToString(sum[:]), started: make(chan int, 16), release: make(chan struct{})}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := int(h.n.Add(1))
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		half := len(img) / 2
		if _, err := w.Write(img[:half]); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		select {
		case h.started <- n:
		default:
		}
		select {
		case <-h.release:
		case <-r.Context().Done(): // the fetcher went away (killed)
			return
		}
		_, _ = w.Write(img[half:])
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(h.unblock) // before srv.Close, which waits for the handlers
	h.url = srv.URL + "/" + name
	return h
}

// unblock lets every held GET finish, now and later.
func (h *heldImage) unblock() { h.once.Do(func() { close(h.release) }) }

// waitGET waits for the next GET to have received its first half.
func (h *heldImage) waitGET(t *testing.T, d time.Duration, what string) int {
	t.Helper()
	select {
	case n := <-h.started:
		return n
	case <-time.After(d):
		t.Fatalf("%s: no GET of the held image within %v", what, d)
		return 0
	}
}

// poolVolumes lists the volume files of a pool directory whose names start
// with prefix.
func poolVolumes(t *testing.T, dir, prefix string) []string {
	t.Helper()
	files, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		if strings.HasPrefix(f.Name(), prefix) {
			out = append(out, f.Name())
		}
	}
	return out
}
