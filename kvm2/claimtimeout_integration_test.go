//go:build integration

package kvm2

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/go-logr/logr/testr"
	"libvirt.org/go/libvirtxml"
)

// Config.ClaimTimeout reaches the entry's image cache. A claim on the
// entry's base left by another process 30 s ago and not refreshed since
// (its holder was killed mid-fetch) is a live writer's under the default
// claim timeout (2m): Create waits for it, here until its 5 s deadline,
// and never deletes it. Under a ClaimTimeout of 10s it is stale: Create
// takes it over at once and fetches the base (under the default it would
// wait 90 s more, past the 1 min deadline).
func TestIntegrationClaimTimeout(t *testing.T) {
	e := newLifecycleEnv(t)
	for i, tc := range []struct {
		name         string
		claimTimeout time.Duration
		taken        bool
	}{
		{"default 2m: a live claim, waited for", 0, false},
		{"10s: stale, taken over", 10 * time.Second, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.cfg
			cfg.ClaimTimeout = tc.claimTimeout
			p := openT(t, cfg, testr.New(t))
			// A claim as imagecache names it (see its package doc):
			// "claim-" + the base without "base-", the time of its last
			// refresh in Unix ns, and a refreshing writer's 32-hex token.
			claim := "claim-" + strings.TrimPrefix(e.baseVol, "base-") + "." +
				strconv.FormatInt(time.Now().Add(-30*time.Second).UnixNano(), 10) + "." +
				strings.Repeat("c", 16) + strings.Repeat(strconv.Itoa(i), 16)
			putEmptyVolume(t, cfg, claim)
			budget := time.Minute
			if !tc.taken {
				budget = 5 * time.Second
				t.Cleanup(func() { deleteVolumeT(t, cfg, claim) })
			}
			ctx, cancel := context.WithTimeout(context.Background(), budget)
			defer cancel()
			spec := egressproxy.Spec{Name: "claim" + strconv.Itoa(i), UID: "uid-claim" + strconv.Itoa(i), MachineType: "tiny"}
			start := time.Now()
			_, err := p.Create(ctx, spec)
			took := time.Since(start)
			left := slices.Contains(volumeNames(t, cfg), claim)
			if !tc.taken {
				if errs.Code(err) != errs.DeadlineExceeded || !left {
					t.Fatalf("Create beside a claim refreshed 30 s ago, ClaimTimeout default: %v (code %v), claim still there %v; want DeadlineExceeded and the claim kept", err, errs.Code(err), left)
				}
				return
			}
			if err != nil || left {
				t.Fatalf("Create beside a claim refreshed 30 s ago, ClaimTimeout %v: %v after %v, claim still there %v; want it taken over", tc.claimTimeout, err, took.Round(time.Millisecond), left)
			}
			t.Logf("took the stale claim over and created in %v", took.Round(time.Millisecond))
			if err := p.Delete(context.Background(), spec.Ref()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// putEmptyVolume creates a 0-byte raw volume in cfg.Pool.
func putEmptyVolume(t *testing.T, cfg Config, name string) {
	t.Helper()
	x, err := (&libvirtxml.StorageVolume{
		Name:     name,
		Capacity: &libvirtxml.StorageVolumeSize{Value: 0},
		Target:   &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "raw"}},
	}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		pool, err := l.StoragePoolLookupByName(cfg.Pool)
		if err != nil {
			return err
		}
		_, err = l.StorageVolCreateXML(pool, x, 0)
		return err
	}); err != nil {
		t.Fatalf("create volume %s: %v", name, err)
	}
}

// deleteVolumeT deletes a volume of cfg.Pool if it is there.
func deleteVolumeT(t *testing.T, cfg Config, name string) {
	t.Helper()
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		pool, err := l.StoragePoolLookupByName(cfg.Pool)
		if err != nil {
			return err
		}
		v, err := l.StorageVolLookupByName(pool, name)
		if err != nil {
			return nil // gone already
		}
		return l.StorageVolDelete(v, 0)
	}); err != nil {
		t.Errorf("delete volume %s: %v", name, err)
	}
}

// volumeNames lists the names of the entry's volumes in cfg.Pool.
func volumeNames(t *testing.T, cfg Config) []string {
	t.Helper()
	var names []string
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		vols, err := entryVolumes(l, cfg, false)
		for _, v := range vols {
			names = append(names, v.Name)
		}
		return err
	}); err != nil {
		t.Fatalf("list volumes: %v", err)
	}
	return names
}
