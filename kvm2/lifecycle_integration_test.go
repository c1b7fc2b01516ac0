//go:build integration

package kvm2

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// lifecycleEnv is a provider config on the real stack with a tiny qcow2
// base served over HTTP and an isolated libvirt network (no forwarding:
// nothing leaves the host).
type lifecycleEnv struct {
	cfg     Config
	network string
	baseVol string
}

func randSuffix(t *testing.T) string {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func newLifecycleEnv(t *testing.T) *lifecycleEnv {
	t.Helper()
	cfg := stackConfig(t)
	sfx := randSuffix(t)
	cfg.Entry = "k2it" + sfx
	cfg.Owner = "kvm2-tests"
	cfg.MachineTypes = map[string]MachineType{"tiny": {VCPUs: 1, MemoryMiB: 128}}

	img := teststack.TinyQCOW2(t)
	sum := sha256.Sum256(img)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(len(img)))
		_, _ = w.Write(img)
	}))
	t.Cleanup(srv.Close)
	cfg.Images = map[string]imagecache.Image{"tiny": {URL: srv.URL + "/tiny.qcow2", SHA256: hex.EncodeToString(sum[:])}}

	// An isolated network (no <forward>): guests reach nothing beyond it.
	e := &lifecycleEnv{network: "k2it-" + sfx, baseVol: basecache.BaseName(cfg.Entry, "tiny", "qcow2")}
	nx, err := (&libvirtxml.Network{
		Name:   e.network,
		Bridge: &libvirtxml.NetworkBridge{Name: "vbk2" + sfx},
		IPs: []libvirtxml.NetworkIP{{
			Address: "10.213.7.1", Netmask: "255.255.255.0",
			DHCP: &libvirtxml.NetworkDHCP{Ranges: []libvirtxml.NetworkDHCPRange{{Start: "10.213.7.10", End: "10.213.7.100"}}},
		}},
	}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error { _, err := l.NetworkCreateXML(nx); return err }); err != nil {
		t.Fatalf("create network: %v", err)
	}
	cfg.Network = e.network
	e.cfg = cfg
	t.Cleanup(func() {
		// Remove every domain and volume of this test entry, then the network.
		err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
			if err := removeEntry(l, cfg); err != nil {
				return err
			}
			n, err := l.NetworkLookupByName(e.network)
			if err != nil {
				return err
			}
			return l.NetworkDestroy(n)
		})
		if err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return e
}

// entryDomains lists the domains, running or not, whose names contain
// entry.
func entryDomains(l *libvirt.Libvirt, entry string) ([]libvirt.Domain, error) {
	doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(doms, func(d libvirt.Domain) bool { return !strings.Contains(d.Name, entry) }), nil
}

// entryVolumes lists the volumes of cfg.Pool whose names contain cfg.Entry,
// after refreshing the pool; a failed refresh is an error only when strict.
func entryVolumes(l *libvirt.Libvirt, cfg Config, strict bool) ([]libvirt.StorageVol, error) {
	pool, err := l.StoragePoolLookupByName(cfg.Pool)
	if err != nil {
		return nil, err
	}
	if err := l.StoragePoolRefresh(pool, 0); err != nil && strict {
		return nil, err
	}
	vols, _, err := l.StoragePoolListAllVolumes(pool, 1, 0)
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(vols, func(v libvirt.StorageVol) bool { return !strings.Contains(v.Name, cfg.Entry) }), nil
}

// hostFacts reads, with a connection of its own, the domains and volumes
// of an entry.
type hostFacts struct {
	domains map[string]libvirt.DomainState
	volumes map[string]string // name -> backing store path ("" when none)
	paths   map[string]string // name -> path
}

func readHost(t *testing.T, cfg Config) hostFacts {
	t.Helper()
	f := hostFacts{domains: map[string]libvirt.DomainState{}, volumes: map[string]string{}, paths: map[string]string{}}
	err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		doms, err := entryDomains(l, cfg.Entry)
		if err != nil {
			return err
		}
		for _, d := range doms {
			st, _, err := l.DomainGetState(d, 0)
			if err != nil {
				return err
			}
			f.domains[d.Name] = libvirt.DomainState(st)
		}
		vols, err := entryVolumes(l, cfg, true)
		if err != nil {
			return err
		}
		for _, v := range vols {
			x, err := l.StorageVolGetXMLDesc(v, 0)
			if err != nil {
				return err
			}
			var sv libvirtxml.StorageVolume
			if err := sv.Unmarshal(x); err != nil {
				return err
			}
			f.volumes[v.Name] = ""
			if sv.BackingStore != nil {
				f.volumes[v.Name] = sv.BackingStore.Path
			}
			if sv.Target != nil {
				f.paths[v.Name] = sv.Target.Path
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("read host: %v", err)
	}
	return f
}

// assertOnlyBases reads the host and reports any domain or non-base volume
// of the entry left on it (when is appended to the messages).
func assertOnlyBases(t *testing.T, cfg Config, when string) hostFacts {
	t.Helper()
	facts := readHost(t, cfg)
	if len(facts.domains) != 0 {
		t.Errorf("domains left%s: %v", when, facts.domains)
	}
	for v := range facts.volumes {
		if !strings.HasPrefix(v, "base-") {
			t.Errorf("volume left%s: %s", when, v)
		}
	}
	return facts
}

// downloadVolume reads a volume's bytes through libvirt.
func downloadVolume(t *testing.T, cfg Config, name string) []byte {
	t.Helper()
	var buf bytes.Buffer
	err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		pool, err := l.StoragePoolLookupByName(cfg.Pool)
		if err != nil {
			return err
		}
		v, err := l.StorageVolLookupByName(pool, name)
		if err != nil {
			return err
		}
		return l.StorageVolDownload(v, &buf, 0, 0, 0)
	})
	if err != nil {
		t.Fatalf("download %s: %v", name, err)
	}
	return buf.Bytes()
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// OpenLifecycleT opens a Provider on a fresh lifecycle env, after adjust (if
// not nil) has changed a copy of its Config, and returns it with a test
// context. It is exported for the external test package kvm2_test, whose
// files may import internal/benchutil (which imports kvm2).
func OpenLifecycleT(t *testing.T, adjust func(*Config)) (*provider, context.Context) {
	t.Helper()
	cfg := newLifecycleEnv(t).cfg
	if adjust != nil {
		adjust(&cfg)
	}
	return openT(t, cfg, testr.New(t)), ctxT(t)
}

func TestIntegrationLifecycle(t *testing.T) {
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.New(t))
	ctx := ctxT(t)

	specs := []egressproxy.Spec{
		{Name: "proxy-a", UID: "uid-a-" + randSuffix(t), UserData: "#cloud-config\nhostname: a\n"},
		{Name: "proxy-b", UID: "uid-b-" + randSuffix(t), UserData: "#cloud-config\nhostname: b\n", Port: 8080},
	}
	created := map[string]egressproxy.Instance{}
	for i, s := range specs {
		start := time.Now()
		inst, err := p.Create(ctx, s)
		if err != nil {
			t.Fatalf("Create %s: %v", s.Name, err)
		}
		t.Logf("Create %s → %s in %v (cold base fetch: %v)", s.Name, inst.State, time.Since(start).Round(time.Millisecond), i == 0)
		if inst.State != egressproxy.StateProvisioning || inst.UID != s.UID || inst.Name != s.Name {
			t.Errorf("Create returned %+v", inst)
		}
		created[s.Name] = inst
	}

	facts := readHost(t, e.cfg)
	basePath := facts.paths[e.baseVol]
	if basePath == "" {
		t.Fatalf("base volume %s not in pool: %v", e.baseVol, facts.volumes)
	}
	for _, s := range specs {
		dn := domainName(e.cfg.Entry, s.Name)
		if st := facts.domains[dn]; st != libvirt.DomainRunning {
			t.Errorf("domain %s state %d, want running", dn, st)
		}
		if got := facts.volumes[overlayVolume(dn)]; got != basePath {
			t.Errorf("overlay %s backed by %q, want %q", overlayVolume(dn), got, basePath)
		}
		iso := downloadVolume(t, e.cfg, seedVolume(dn))
		label, files := readSeed(t, iso)
		if label != "cidata" || files["user-data"] != s.UserData || !strings.Contains(files["meta-data"], s.UID) {
			t.Errorf("seed %s: label %q files %v", seedVolume(dn), label, files)
		}
	}

	for _, s := range specs {
		got, err := p.Get(ctx, s.Ref())
		if err != nil {
			t.Fatalf("Get %s: %v", s.Name, err)
		}
		want := created[s.Name]
		if got.State != egressproxy.StateProvisioning || got.UID != s.UID || !got.CreatedAt.Equal(want.CreatedAt) || got.Port != s.EffectivePort() || got.IP != "" {
			t.Errorf("Get %s = %+v, want Provisioning, UID %s, created %v, port %d", s.Name, got, s.UID, want.CreatedAt, s.EffectivePort())
		}
	}
	list, err := p.List(ctx)
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	if len(list) != 2 || list[0].Name != "proxy-a" || list[1].Name != "proxy-b" || list[0].UID != specs[0].UID || list[1].UID != specs[1].UID {
		t.Fatalf("List = %+v, want exactly proxy-a and proxy-b", list)
	}

	// Create again with the same UID: the same instance, nothing new.
	again, err := p.Create(ctx, specs[0])
	if err != nil || !again.CreatedAt.Equal(created["proxy-a"].CreatedAt) || again.UID != specs[0].UID {
		t.Errorf("second Create = %+v, %v; want the first instance", again, err)
	}
	if f2 := readHost(t, e.cfg); len(f2.domains) != len(facts.domains) || len(f2.volumes) != len(facts.volumes) {
		t.Errorf("second Create changed the host: domains %v→%v volumes %d→%d", facts.domains, f2.domains, len(facts.volumes), len(f2.volumes))
	}
	// The same name with another UID is taken.
	if _, err := p.Create(ctx, egressproxy.Spec{Name: "proxy-a", UID: "someone-else"}); errs.Code(err) != errs.Permanent {
		t.Errorf("Create of a taken name: %v (code %v), want Permanent", err, errs.Code(err))
	}
	if _, err := p.Get(ctx, egressproxy.Ref{Name: "proxy-a", UID: "someone-else"}); errs.Code(err) != errs.NotFound {
		t.Errorf("Get with another UID: %v, want NotFound", err)
	}

	// Delete both: domains, overlays and seeds go, the base stays.
	for _, s := range specs {
		if err := p.Delete(ctx, s.Ref()); err != nil {
			t.Fatalf("Delete %s: %v", s.Name, err)
		}
	}
	after := assertOnlyBases(t, e.cfg, " after Delete")
	if _, ok := after.volumes[e.baseVol]; !ok {
		t.Errorf("Delete removed the base %s", e.baseVol)
	}
	for _, s := range specs {
		if err := p.Delete(ctx, s.Ref()); err != nil {
			t.Errorf("second Delete %s: %v", s.Name, err)
		}
		if _, err := p.Get(ctx, s.Ref()); errs.Code(err) != errs.NotFound {
			t.Errorf("Get after Delete: %v, want NotFound", err)
		}
	}
	if list, err := p.List(ctx); err != nil || len(list) != 0 {
		t.Errorf("List after Delete = %v, %v", list, err)
	}
}

// foreignDomain defines (does not start) a disk-less domain carrying meta
// as its <metadata> inner XML.
func foreignDomain(t *testing.T, cfg Config, name, meta string) {
	t.Helper()
	d := libvirtxml.Domain{
		Type: "qemu", Name: name,
		Memory: &libvirtxml.DomainMemory{Value: 64, Unit: "MiB"},
		OS:     &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Arch: "x86_64", Type: "hvm"}},
	}
	if meta != "" {
		d.Metadata = &libvirtxml.DomainMetadata{XML: meta}
	}
	x, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error { _, err := l.DomainDefineXML(x); return err }); err != nil {
		t.Fatalf("define %s: %v", name, err)
	}
}

func TestIntegrationForeignDomainsUntouched(t *testing.T) {
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.New(t))
	ctx := ctxT(t)
	mine, err := p.Create(ctx, egressproxy.Spec{Name: "mine", UID: "uid-mine"})
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	meta := func(entry, owner, uid string) string {
		s, err := marshalMetadata(instanceMeta{UID: uid, Created: time.Now(), Entry: entry, Owner: owner, Port: 3128})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	foreign := map[string]string{
		"no-meta":     "",
		"other-entry": meta("otherentry", e.cfg.Owner, "uid-x"),
		"other-owner": meta(e.cfg.Entry, "another-operator", "uid-x"),
		"older-ns":    strings.ReplaceAll(meta(e.cfg.Entry, e.cfg.Owner, "uid-x"), "/instance/v1", "/instance/v0"),
		"other-tool":  `<app:vm xmlns:app="https://example.com/app"><uid>uid-x</uid></app:vm>`,
	}
	for name, m := range foreign {
		foreignDomain(t, e.cfg, domainName(e.cfg.Entry, name), m)
	}
	list, err := p.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].Name != "mine" || list[0].UID != mine.UID {
		t.Errorf("List = %+v, want only 'mine'", list)
	}
	for name := range foreign {
		ref := egressproxy.Ref{Name: name, UID: "uid-x"}
		if _, err := p.Get(ctx, ref); errs.Code(err) != errs.NotFound {
			t.Errorf("Get %s: %v, want NotFound", name, err)
		}
		if err := p.Delete(ctx, ref); err != nil {
			t.Errorf("Delete %s: %v, want nil (missing instance)", name, err)
		}
		if _, err := p.Create(ctx, egressproxy.Spec{Name: name, UID: "uid-x"}); errs.Code(err) != errs.Permanent {
			t.Errorf("Create over %s: %v, want Permanent (name taken)", name, err)
		}
	}
	facts := readHost(t, e.cfg)
	for name := range foreign {
		if _, ok := facts.domains[domainName(e.cfg.Entry, name)]; !ok {
			t.Errorf("foreign domain %s was removed", name)
		}
	}
}

func TestIntegrationCreateFaultLeavesNothing(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Config)
		want   errs.ErrorCode
	}{
		// The domain is defined, then refused at start: the volumes and
		// the definition this Create made must go.
		{"network missing", func(c *Config) { c.Network = "k2it-no-such-network" }, errs.Permanent},
		{"kernel missing", func(c *Config) { c.Kernel = "/nonexistent/vmlinuz" }, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newLifecycleEnv(t)
			cfg := e.cfg
			tt.mutate(&cfg)
			p := openT(t, cfg, testr.New(t))
			ctx := ctxT(t)
			spec := egressproxy.Spec{Name: "faulty", UID: "uid-f"}
			_, err := p.Create(ctx, spec)
			if err == nil {
				t.Fatal("Create succeeded")
			}
			t.Logf("Create error (%v): %v", errs.Code(err), err)
			if tt.want != 0 && errs.Code(err) != tt.want {
				t.Errorf("code %v, want %v", errs.Code(err), tt.want)
			}
			if c := errs.Code(err); c != errs.Permanent && c != errs.Transient {
				t.Errorf("unclassified error %v", c)
			}
			assertOnlyBases(t, cfg, "")
			if list, err := p.List(ctx); err != nil || len(list) != 0 {
				t.Errorf("List = %v, %v", list, err)
			}
		})
	}
}

func TestIntegrationCreatePoolStopped(t *testing.T) {
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.New(t))
	ctx := ctxT(t)
	// Warm the base first, so the only fault is the stopped pool (it is
	// met by the base check of Create, before any instance volume).
	if _, err := p.Create(ctx, egressproxy.Spec{Name: "warm", UID: "uid-w"}); err != nil {
		t.Fatalf("warm Create: %v", err)
	}
	if err := p.Delete(ctx, egressproxy.Ref{Name: "warm", UID: "uid-w"}); err != nil {
		t.Fatal(err)
	}
	poolOp := func(stop bool) error {
		return rawLibvirt(t, func(l *libvirt.Libvirt) error {
			sp, err := l.StoragePoolLookupByName(e.cfg.Pool)
			if err != nil {
				return err
			}
			if stop {
				return l.StoragePoolDestroy(sp)
			}
			return l.StoragePoolCreate(sp, 0)
		})
	}
	if err := poolOp(true); err != nil {
		t.Fatalf("stop pool: %v", err)
	}
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			if err := poolOp(false); err != nil {
				t.Errorf("restart pool: %v", err)
			}
		}
	})
	_, err := p.Create(ctx, egressproxy.Spec{Name: "faulty", UID: "uid-f"})
	if err == nil {
		t.Fatal("Create with the pool stopped succeeded")
	}
	t.Logf("Create error (%v): %v", errs.Code(err), err)
	if err := poolOp(false); err != nil {
		t.Fatalf("restart pool: %v", err)
	}
	restarted = true
	assertOnlyBases(t, e.cfg, "")
	if err := p.Delete(ctx, egressproxy.Ref{Name: "faulty", UID: "uid-f"}); err != nil {
		t.Errorf("Delete after the fault: %v", err)
	}
}

func TestIntegrationMetacharactersRoundTrip(t *testing.T) {
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.New(t))
	ctx := ctxT(t)
	uid := `</egressproxy:uid>"quote' <x>&amp; ünï✓ `
	uid += strings.Repeat("u", naming.MaxUIDLen-len(uid)-4) + "end!"
	if len(uid) != naming.MaxUIDLen {
		t.Fatalf("uid length %d", len(uid))
	}
	name := strings.Repeat("n", naming.MaxNameLen)
	ud := "#cloud-config\nwrite_files:\n- content: \"</user-data><&>'\\\"ünï\"\n  path: /tmp/x\n"
	ud += strings.Repeat("#", naming.MaxUserDataBytes-len(ud))
	spec := egressproxy.Spec{Name: name, UID: uid, UserData: ud}
	if _, err := p.Create(ctx, spec); err != nil {
		t.Fatalf("Create: %v", err)
	}
	got, err := p.Get(ctx, spec.Ref())
	if err != nil || got.UID != uid || got.Name != name {
		t.Fatalf("Get = %+v, %v", got, err)
	}
	_, files := readSeed(t, downloadVolume(t, e.cfg, seedVolume(domainName(e.cfg.Entry, name))))
	if files["user-data"] != ud {
		t.Errorf("user-data changed on the way (%d vs %d bytes)", len(files["user-data"]), len(ud))
	}
	if err := p.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}

	// Oversized user-data is rejected before anything is created.
	big := egressproxy.Spec{Name: "big", UID: "uid-big", UserData: strings.Repeat("x", naming.MaxUserDataBytes+1)}
	_, err = p.Create(ctx, big)
	var fe *errs.FieldError
	if errs.Code(err) != errs.Permanent || !errors.As(err, &fe) || fe.Field != "UserData" {
		t.Errorf("oversized user-data: %v", err)
	}
	assertOnlyBases(t, e.cfg, "")
}

// removeEntry destroys and undefines every domain of cfg's entry and
// deletes every volume of it: a test's cleanup.
func removeEntry(l *libvirt.Libvirt, cfg Config) error {
	doms, err := entryDomains(l, cfg.Entry)
	if err != nil {
		return err
	}
	for _, d := range doms {
		_ = l.DomainDestroy(d)
		_ = l.DomainUndefineFlags(d, libvirt.DomainUndefineManagedSave|libvirt.DomainUndefineSnapshotsMetadata|libvirt.DomainUndefineNvram)
	}
	vols, err := entryVolumes(l, cfg, false)
	for _, v := range vols {
		_ = l.StorageVolDelete(v, 0)
	}
	return err
}
