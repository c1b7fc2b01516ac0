package basecache

import (
	"context"
	"fmt"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
)

// TestClassifyFollowsSharedTable: for every libvirt error number, the cache
// gives the class of the table kvm2 uses too, except that an object missing
// underneath the cache is Transient (its calls are about an image, which a
// retry fetches again), never NotFound.
func TestClassifyFollowsSharedTable(t *testing.T) {
	t.Parallel()
	c := &Cache{cfg: Config{Pool: "p"}}
	for n := libvirt.ErrOk; n <= libvirt.ErrAgentCommandFailed+1; n++ {
		err := fmt.Errorf("step: %w", libvirt.Error{Code: uint32(n), Message: fmt.Sprintf("libvirt error %d", n)})
		v := libvirterr.Of(err)
		want := v.Code
		if v.Missing {
			want = errs.Transient
		}
		if got := errs.Code(c.classify(context.Background(), err)); got != want {
			t.Errorf("classify(libvirt error %d) = %v, want %v (shared table: %+v)", n, got, want, v)
		}
	}
}
