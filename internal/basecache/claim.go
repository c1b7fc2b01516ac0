package basecache

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// Claim tokens. A claim volume is "claim-<stem>.<unix ns>.<token>"; the
// token of a claim this package takes is 32 hex digits: the taking cache's
// instance (16) and the claim's own (16). Its holder refreshes it (a new
// volume with the same token and a newer time, then the old one deleted)
// every ClaimTimeout/4, so liveness reads from the names alone. Claims with
// any other token length come from writers that do not refresh and keep the
// older rule (stale after twice the transfer budget).
const (
	instanceBytes = 8
	claimBytes    = 8
	tokenLen      = 2 * (instanceBytes + claimBytes)
)

// heartbeatToken reports whether a claim token is of a refreshed claim.
func heartbeatToken(tok string) bool { return len(tok) == tokenLen }

// snapshot builds decide's input for base name from the pool's names.
func (c *Cache) snapshot(names []string, name, want, ownToken string) snapshot {
	c.mu.Lock()
	live := make(map[string]bool, len(c.live))
	for t := range c.live {
		live[t] = true
	}
	c.mu.Unlock()
	return snapshot{Names: names, Base: name, Want: want, OwnToken: ownToken, Now: time.Now(),
		StaleAfter: c.staleAfter(), HeartbeatStale: c.cfg.ClaimTimeout, Instance: c.instance, Live: live}
}

// underClaim creates a claim for base name, decides again with it held and,
// unless another writer also holds one, runs fn with a context that ends
// if the claim cannot be kept (refreshed). retry is true when the caller
// should look again (backed off). The claim is released afterwards.
func (c *Cache) underClaim(ctx context.Context, name string, fn func(context.Context, decision) (Base, error)) (b Base, retry bool, err error) {
	tok := c.instance + randHex(claimBytes)
	c.mu.Lock()
	c.live[tok] = true
	c.mu.Unlock()
	claim := claimName(name, time.Now(), tok)
	vol, err := c.createEmptyVol(ctx, claim)
	if err != nil {
		c.release(tok)
		return Base{}, false, c.classify(ctx, fmt.Errorf("create claim %s: %w", claim, err))
	}
	hctx, cancel := context.WithCancelCause(ctx)
	hb := &heartbeat{c: c, base: name, tok: tok, cur: vol, cancel: cancel, stop: make(chan struct{}), done: make(chan struct{})}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		hb.run(hctx)
	}()
	defer func() {
		cur := hb.end()
		cancel(nil)
		c.deleteQuietHandle(ctx, cur.Name, &cur)
		c.release(tok)
	}()
	d, err := c.look(hctx, imagecache.Image{}, name, tok)
	if err != nil {
		return Base{}, false, err
	}
	if d.Action == actBackOff {
		c.log.V(1).Info("another writer claimed the base too; backing off", "volume", name, "claims", d.Others)
		cur := hb.end()
		c.deleteQuietHandle(ctx, cur.Name, &cur)
		if err := sleep(ctx, pollInterval/2+time.Duration(mrand.Int64N(int64(pollInterval)))); err != nil {
			return Base{}, false, errs.Errorf(errs.Transient, "base %s: contended by %s: %w", name, strings.Join(d.Others, ", "), err)
		}
		return Base{}, true, nil
	}
	if d.Action != actFetch && d.Action != actHit && d.Action != actMismatch && d.Action != actAmbiguous {
		return Base{}, true, nil
	}
	b, err = fn(hctx, d)
	if cause := context.Cause(hctx); err != nil && cause != nil && ctx.Err() == nil && cause != context.Canceled {
		err = errs.Errorf(errs.Transient, "base %s: %w (%w)", name, cause, err)
	}
	return b, false, err
}

// release forgets a claim token: from now on a claim volume with it is an
// orphan of ours (its deletion failed) and the next look removes it.
func (c *Cache) release(tok string) {
	c.mu.Lock()
	delete(c.live, tok)
	c.mu.Unlock()
}

// heartbeat keeps one claim fresh.
type heartbeat struct {
	c      *Cache
	base   string
	tok    string
	cancel context.CancelCauseFunc
	stop   chan struct{}
	done   chan struct{}
	cur    libvirt.StorageVol // the claim volume now, as created (owned by run until done)
}

// errClaimLost ends the work of a holder that could not refresh its claim.
var errClaimLost = fmt.Errorf("lost its claim: it could not be refreshed, so another writer may take it over")

func (h *heartbeat) run(ctx context.Context) {
	defer close(h.done)
	iv := h.c.cfg.ClaimTimeout / 4
	lastOK := time.Now()
	t := time.NewTicker(iv)
	defer t.Stop()
	for {
		select {
		case <-h.stop:
			return
		case <-ctx.Done():
			return
		case <-t.C:
		}
		next := claimName(h.base, time.Now(), h.tok)
		rctx, cancel := context.WithTimeout(ctx, iv)
		vol, err := h.c.createEmptyVol(rctx, next)
		cancel()
		if err != nil {
			h.c.log.V(1).Info("could not refresh the claim; trying again", "volume", h.base, "err", err.Error())
			if time.Since(lastOK) > h.c.cfg.ClaimTimeout/2 {
				h.c.log.Info("giving the work up: the claim could not be refreshed", "volume", h.base, "err", err.Error())
				h.cancel(fmt.Errorf("%w (for %v: %v)", errClaimLost, time.Since(lastOK).Round(time.Second), err))
				return
			}
			continue
		}
		lastOK = time.Now()
		prev := h.cur
		h.cur = vol
		h.c.deleteQuietHandle(ctx, prev.Name, &prev)
	}
}

// end stops the heartbeat and returns the claim volume it left.
func (h *heartbeat) end() libvirt.StorageVol {
	select {
	case <-h.stop:
	default:
		close(h.stop)
	}
	<-h.done
	return h.cur
}
