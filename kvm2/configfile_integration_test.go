//go:build integration

package kvm2

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/go-logr/logr/testr"
	"github.com/google/go-cmp/cmp"
	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// A config written to a YAML file and read back with ParseConfig drives the
// real stack: Check, then Create, Get and Delete of one instance; with the
// host key pinned by the known_hosts lines in the file (a block), Check
// reaches the host. The same config with a credentialed image URL marshals
// without the secret, and the redacted file is refused, naming the key and
// its line, before anything is dialled.
func TestIntegrationConfigFile(t *testing.T) {
	e := newLifecycleEnv(t)
	b, err := yaml.Marshal(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"dialTimeout: 5s\n", "machineTypes:\n", "url: http://"} {
		if !strings.Contains(string(b), key) {
			t.Errorf("marshalled config lacks %q:\n%s", key, b)
		}
	}
	path := writeFile(t, "entry.yaml", b)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		t.Fatalf("ParseConfig:\n%s\n%v", data, err)
	}
	if d := cmp.Diff(e.cfg, cfg); d != "" {
		t.Fatalf("file round trip (-want +got):\n%s", d)
	}

	p := openT(t, cfg, testr.New(t))
	if h := checkT(t, p); !h.Reachable || h.Reason != egressproxy.ReasonNone {
		t.Fatalf("Check = %+v", h)
	}
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "from-file", UID: "uid-file-" + randSuffix(t)}
	inst, err := p.Create(ctx, spec)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if inst.Name != spec.Name || inst.UID != spec.UID {
		t.Errorf("Create = %+v", inst)
	}
	if got, err := p.Get(ctx, spec.Ref()); err != nil || got.UID != spec.UID {
		t.Errorf("Get = %+v, %v", got, err)
	}
	if err := p.Delete(ctx, spec.Ref()); err != nil {
		t.Fatalf("Delete: %v", err)
	}

	checkKnownHostsBlock(t, e.cfg)
	checkRedactedRefused(t, e.cfg)
}

// checkKnownHostsBlock checks that cfg with its host key pinned in the
// file itself, the known_hosts lines as a YAML block, reads back with
// ParseConfig and reaches the host.
func checkKnownHostsBlock(t *testing.T, cfg Config) {
	t.Helper()
	kh, err := os.ReadFile(cfg.KnownHostsFile)
	if err != nil {
		t.Fatal(err)
	}
	pinned := cfg
	pinned.KnownHostsFile, pinned.KnownHosts = "", kh
	b, err := yaml.Marshal(pinned)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "knownHosts: |") {
		t.Errorf("knownHosts is not written as a block:\n%s", b)
	}
	pc, err := ParseConfig(b)
	if err != nil {
		t.Fatalf("ParseConfig(knownHosts block):\n%s\n%v", b, err)
	}
	if h := checkT(t, openT(t, pc, testr.New(t))); !h.Reachable || h.Reason != egressproxy.ReasonNone {
		t.Fatalf("Check with knownHosts from the file = %+v", h)
	}
}

// checkRedactedRefused checks that credentials in cfg's image URL never
// reach the file, and that the redacted file is refused, naming the URL's
// key path and line.
func checkRedactedRefused(t *testing.T, cfg Config) {
	t.Helper()
	const secret = "s3cr3t-passw0rd"
	withCred := cfg
	img := withCred.Images["tiny"]
	img.URL = strings.Replace(img.URL, "http://", "http://op:"+secret+"@", 1)
	withCred.Images = map[string]imagecache.Image{"tiny": img}
	b, err := yaml.Marshal(withCred)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), secret) || strings.Contains(withCred.String(), secret) {
		t.Fatalf("secret marshalled:\n%s", b)
	}
	_, err = ParseConfig(b)
	var fe *errs.FieldError
	if !errors.As(err, &fe) || fe.Field != "images.tiny.url" || fe.Line == 0 {
		t.Fatalf("ParseConfig(redacted) = %v, want the URL refused", err)
	}
}
