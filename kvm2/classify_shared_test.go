package kvm2

import (
	"fmt"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
)

// TestClassifyFollowsSharedTable: for every libvirt error number, kvm2's
// class and Check's health reason are the shared table's (the one
// imagecache uses too).
func TestClassifyFollowsSharedTable(t *testing.T) {
	t.Parallel()
	for n := libvirt.ErrOk; n <= libvirt.ErrAgentCommandFailed+1; n++ {
		err := fmt.Errorf("step: %w", libvirt.Error{Code: uint32(n), Message: fmt.Sprintf("libvirt error %d", n)})
		v := libvirterr.Of(err)
		if got := errs.Code(classify(err)); got != v.Code {
			t.Errorf("classify(libvirt error %d) = %v, shared table says %v", n, got, v.Code)
		}
		if got := healthReason(err); got != v.Reason {
			t.Errorf("healthReason(libvirt error %d) = %q, shared table says %q", n, got, v.Reason)
		}
	}
}
