package kvm2

import (
	"github.com/egressproxy/egressproxy/imagecache"
)

// images checks Images and DefaultImage.
func (k *checker) images(c Config) {
	for _, key := range sortedKeys(c.Images) {
		img := c.Images[key]
		at := []step{fieldStep("Images"), keyStep(key)}
		if k.mapKey(key, at) {
			continue
		}
		if img.Key != "" && img.Key != key {
			k.add(img.Key, "must be empty or equal the map key", append(at, fieldStep("Key"))...)
			continue
		}
		img.Key = key
		k.addErr(img.Validate(), at...)
	}
	_, known := c.Images[c.DefaultImage]
	switch {
	case c.DefaultImage == "":
		if len(c.Images) > 1 {
			k.add("", "is required when {Images} has several entries", fieldStep("DefaultImage"))
		}
	case !known:
		k.add(c.DefaultImage, "must be a key of {Images}", fieldStep("DefaultImage"))
	}
}

// imagesWithKeys returns a copy of imgs with each image's Key set to its
// map key.
func imagesWithKeys(imgs map[string]imagecache.Image) map[string]imagecache.Image {
	if imgs == nil {
		return nil
	}
	out := make(map[string]imagecache.Image, len(imgs))
	for key, img := range imgs {
		img.Key = key
		out[key] = img
	}
	return out
}
