package benchutil

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/digitalocean/go-libvirt"
	"go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// FetchResult is one cold fetch by the library: the whole Ensure and the
// phases imagecache reports as spans (imagecache.Fetch spans HTTP GET +
// volume creation + upload + verify + publish; imagecache.Upload is the
// stream into the volume until libvirt wrote every byte; imagecache.Verify
// is the physical size check plus the read-back and hash on the host).
type FetchResult struct {
	Bytes  int64
	Ensure time.Duration // wall time of Cache.Ensure (SSH dial included)
	Fetch  time.Duration
	Upload time.Duration
	Verify time.Duration
}

// Link opens an SSH pool and a libvirt session on it to the stack.
// close releases both.
func Link(env teststack.Env, socket string) (lv *libvirtconn.Session, pool *sshconn.Pool, closeFn func(), err error) {
	if socket == "" {
		socket = env.LibvirtSocket
	}
	pool, err = sshconn.New(sshconn.Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts}, nil)
	if err != nil {
		return nil, nil, nil, err
	}
	lv = libvirtconn.New(pool, libvirtconn.Config{Socket: socket, URI: env.LibvirtURI}, nil)
	return lv, pool, func() { _ = lv.Close(); _ = pool.Close() }, nil
}

// LibraryFetch cold-fetches the image at imageURL (size bytes, digest sum)
// into the stack's pool with imagecache (entry and key name the base),
// records its spans, and evicts the base again when evict is set. Any base
// of that name left by an earlier run is evicted first (untimed).
func LibraryFetch(ctx context.Context, env teststack.Env, entry, key, imageURL, sum string, evict bool) (FetchResult, error) {
	lv, _, closeLink, err := Link(env, "")
	if err != nil {
		return FetchResult{}, err
	}
	defer closeLink()
	rec := tracetest.NewSpanRecorder()
	tp := trace.NewTracerProvider(trace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	cache, err := basecache.New(basecache.SSH(lv), basecache.Config{Entry: entry, Pool: env.Pool, TransferBudget: 10 * time.Minute, TracerProvider: tp})
	if err != nil {
		return FetchResult{}, err
	}
	defer func() { _ = cache.Close() }()
	img := imagecache.Image{Key: key, URL: imageURL, SHA256: sum}
	if err := cache.Evict(ctx, img); err != nil {
		return FetchResult{}, fmt.Errorf("evict leftover base: %w", err)
	}
	start := time.Now()
	if _, err := cache.Ensure(ctx, img); err != nil {
		return FetchResult{}, fmt.Errorf("cold fetch: %w", err)
	}
	res := FetchResult{Ensure: time.Since(start)}
	for _, s := range rec.Ended() {
		d := s.EndTime().Sub(s.StartTime())
		switch s.Name() {
		case "imagecache.Fetch":
			res.Fetch = d
		case "imagecache.Upload":
			res.Upload = d
			for _, a := range s.Attributes() {
				if a.Key == "imagecache.upload.bytes" {
					res.Bytes = a.Value.AsInt64()
				}
			}
		case "imagecache.Verify":
			res.Verify = d
		}
	}
	if res.Fetch == 0 || res.Upload == 0 || res.Verify == 0 {
		return res, errors.New("imagecache did not record fetch, upload and verify spans (was the base already there?)")
	}
	if evict {
		if err := cache.Evict(ctx, img); err != nil {
			return res, fmt.Errorf("evict: %w", err)
		}
	}
	return res, nil
}

// SSHWrapper writes (once) an ssh wrapper in dir that pins the stack's host
// key (UserKnownHostsFile, StrictHostKeyChecking=yes) for virsh's
// `command=` URI parameter: libvirt 9.0's ssh transport does not pass the
// URI's known_hosts to the OpenSSH client, and no_verify must not be used.
func SSHWrapper(env teststack.Env, dir string) (string, error) {
	p := filepath.Join(dir, "ssh-pinned")
	script := fmt.Sprintf("#!/bin/sh\nexec ssh -o UserKnownHostsFile=%s -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes -o BatchMode=yes \"$@\"\n", env.KnownHosts)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	return p, os.WriteFile(p, []byte(script), 0o755)
}

// VirshURI is the qemu+ssh URI of the stack for virsh: key file, pinned
// known_hosts (through wrapper), the private libvirt socket.
func VirshURI(env teststack.Env, wrapper string) string {
	host, port, _ := net.SplitHostPort(env.SSHAddr)
	q := url.Values{}
	q.Set("keyfile", env.SSHKey)
	q.Set("known_hosts", env.KnownHosts)
	q.Set("socket", env.LibvirtSocket)
	q.Set("no_tty", "1")
	q.Set("command", wrapper)
	return fmt.Sprintf("qemu+ssh://%s@%s/system?%s", env.SSHUser, net.JoinHostPort(host, port), q.Encode())
}

func localVirsh(ctx context.Context, env teststack.Env, args ...string) error {
	a := append([]string{"-q", "-c", "qemu:///system?socket=" + env.LibvirtSocket}, args...)
	if out, err := exec.CommandContext(ctx, "virsh", a...).CombinedOutput(); err != nil {
		return fmt.Errorf("virsh %v: %w: %s", args, err, out)
	}
	return nil
}

// VirshUpload creates raw volume vol (untimed, over the local socket),
// times `virsh -c <qemu+ssh URI> vol-upload` of file into it, then deletes
// it (untimed).
func VirshUpload(ctx context.Context, env teststack.Env, wrapper, file, vol string) (time.Duration, error) {
	_ = localVirsh(ctx, env, "vol-delete", "--pool", env.Pool, vol) // leftover of an aborted run
	if err := localVirsh(ctx, env, "vol-create-as", env.Pool, vol, "0", "--format", "raw"); err != nil {
		return 0, err
	}
	defer func() { _ = localVirsh(context.WithoutCancel(ctx), env, "vol-delete", "--pool", env.Pool, vol) }()
	start := time.Now()
	out, err := exec.CommandContext(ctx, "virsh", "-q", "-c", VirshURI(env, wrapper), "vol-upload", "--pool", env.Pool, vol, file).CombinedOutput()
	d := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("virsh vol-upload: %w: %s", err, out)
	}
	return d, nil
}

// SSHCat times `cat file | ssh root@host 'cat > remote'` over the stack's
// sshd (host key pinned), then removes remote (a local path: the stack runs
// on this machine).
func SSHCat(ctx context.Context, env teststack.Env, file, remote string) (time.Duration, error) {
	host, port, _ := net.SplitHostPort(env.SSHAddr)
	script := `cat "$1" | ssh -i "$2" -o UserKnownHostsFile="$3" -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes -o BatchMode=yes -p "$4" "$5" "cat > '$6'"`
	cmd := exec.CommandContext(ctx, "sh", "-c", script, "sh", file, env.SSHKey, env.KnownHosts, port, env.SSHUser+"@"+host, remote)
	defer os.Remove(remote)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	d := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("cat | ssh: %w: %s", err, out)
	}
	return d, nil
}

// Sync flushes dirty pages (the stack writes to this machine's disk) so one
// run's write-back does not slow the next.
func Sync(ctx context.Context) error { return exec.CommandContext(ctx, "sync").Run() }

// VirshVol runs one virsh command against uri (untimed housekeeping such as
// vol-create-as and vol-delete on a host whose socket is not local).
func VirshVol(ctx context.Context, uri string, args ...string) error {
	a := append([]string{"-q", "-c", uri}, args...)
	if out, err := exec.CommandContext(ctx, "virsh", a...).CombinedOutput(); err != nil {
		return fmt.Errorf("virsh %v: %w: %s", args, err, out)
	}
	return nil
}

// Pipeline is one run of the equal-guarantee virsh pipeline: the upload,
// then the read-back through the same transport hashed on the caller.
type Pipeline struct {
	Upload, Download time.Duration
}

// Whole is the pipeline's wall time (upload then read-back).
func (p Pipeline) Whole() time.Duration { return p.Upload + p.Download }

// VirshPipeline gives the same guarantee as the library's cold fetch with
// stock tools: `virsh vol-upload` of file into a fresh raw volume vol, then
// `virsh vol-download vol /dev/stdout | sha256sum`, whose digest must be
// sum (the image's). Both go through uri (qemu+ssh); the volume is created
// and deleted over the same URI, untimed.
func VirshPipeline(ctx context.Context, uri, pool, file, vol, sum string) (Pipeline, error) {
	_ = VirshVol(ctx, uri, "vol-delete", "--pool", pool, vol) // leftover of an aborted run
	if err := VirshVol(ctx, uri, "vol-create-as", pool, vol, "0", "--format", "raw"); err != nil {
		return Pipeline{}, err
	}
	defer func() { _ = VirshVol(context.WithoutCancel(ctx), uri, "vol-delete", "--pool", pool, vol) }()
	var p Pipeline
	start := time.Now()
	out, err := exec.CommandContext(ctx, "virsh", "-q", "-c", uri, "vol-upload", "--pool", pool, vol, file).CombinedOutput()
	p.Upload = time.Since(start)
	if err != nil {
		return p, fmt.Errorf("virsh vol-upload: %w: %s", err, out)
	}
	start = time.Now()
	script := `set -o pipefail; virsh -q -c "$1" vol-download --pool "$2" "$3" /dev/stdout | sha256sum`
	out, err = exec.CommandContext(ctx, "bash", "-c", script, "bash", uri, pool, vol).Output()
	p.Download = time.Since(start)
	if err != nil {
		return p, fmt.Errorf("virsh vol-download | sha256sum: %w", err)
	}
	if got, _, _ := strings.Cut(strings.TrimSpace(string(out)), " "); got != sum {
		return p, fmt.Errorf("virsh vol-download | sha256sum: digest %q, want %s", got, sum)
	}
	return p, nil
}

// DeleteVolumes refreshes pool on l and deletes every volume of it whose
// name match accepts (best effort: a volume that will not go is left), for
// the bench's cleanups between runs.
func DeleteVolumes(l *libvirt.Libvirt, pool string, match func(name string) bool) error {
	p, err := l.StoragePoolLookupByName(pool)
	if err != nil {
		return err
	}
	_ = l.StoragePoolRefresh(p, 0)
	vols, _, err := l.StoragePoolListAllVolumes(p, 1, 0)
	if err != nil {
		return err
	}
	for _, v := range vols {
		if match(v.Name) {
			_ = l.StorageVolDelete(v, 0)
		}
	}
	return nil
}
