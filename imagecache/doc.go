// Package imagecache holds the image catalogue of a kvm2 entry: an Image
// (kvm2.Config.Images maps keys to them) names the URL of a base image,
// its expected sha256 and its format, and Progress is what
// kvm2.Options.ImageProgress is told while a cold image is transferred.
//
// kvm2 keeps one verified base per image in the entry's storage pool: it
// downloads the image once, reads back and hashes what the host stored,
// and only then marks the base usable; entries of one process share the
// download of an image they fetch at the same time. An image URL may carry
// credentials: they are sent, but an Image prints, logs and marshals its
// URL with them redacted.
package imagecache
