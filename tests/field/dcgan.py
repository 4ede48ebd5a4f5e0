"""A DCGAN on scikit-learn's bundled 8x8 digits.

A transposed-convolution generator and a convolutional discriminator, both with BatchNorm and
the DCGAN weight init applied with ``model.apply``; two Adam optimizers;
``nn.BCEWithLogitsLoss`` on the discriminator's logit; the fakes detached for the discriminator's update and reused for the
generator's.

FIELD_FAULT=nan: the log of negative features in the discriminator's forward at step 5.
"""

import os

import torch
import torch.nn as nn
from sklearn.datasets import load_digits

FAULT = os.environ.get("FIELD_FAULT", "")
nz, ngf, ndf = 8, 16, 16


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 2, 1, 0, bias=False),  # 2x2
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False),  # 8x8
            nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False),  # 4x4
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 2x2
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
        )
        self.classifier = nn.Conv2d(ndf * 2, 1, 2, 1, 0, bias=False)
        self.poisoned = False

    def forward(self, input):
        h = self.features(input)
        if self.poisoned:
            h = torch.log(h)  # <- fault
        return self.classifier(h).view(-1, 1).squeeze(1)


def main():
    torch.manual_seed(999)
    digits = torch.tensor(load_digits().images, dtype=torch.float32)
    data = (digits / 8.0 - 1.0).unsqueeze(1)  # [-1, 1], 1 channel
    netG, netD = Generator(), Discriminator()
    netG.apply(weights_init)
    netD.apply(weights_init)
    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(16, nz, 1, 1)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    batch_size = 32
    for i in range(30):
        netD.poisoned = FAULT == "nan" and i == 5
        real = data[torch.randint(len(data), (batch_size,))]
        # (1) the discriminator: maximise log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        output = netD(real)
        errD_real = criterion(output, torch.ones(batch_size))
        errD_real.backward()
        D_x = output.sigmoid().mean().item()
        fake = netG(torch.randn(batch_size, nz, 1, 1))
        output = netD(fake.detach())
        errD_fake = criterion(output, torch.zeros(batch_size))
        errD_fake.backward()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) the generator: maximise log(D(G(z)))
        netG.zero_grad()
        output = netD(fake)
        errG = criterion(output, torch.ones(batch_size))
        errG.backward()
        D_G_z = output.sigmoid().mean().item()
        optimizerG.step()
        if i % 5 == 0:
            print(
                f"[{i}/30] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} "
                f"D(x): {D_x:.4f} D(G(z)): {D_G_z:.4f}"
            )
    with torch.no_grad():
        samples = netG(fixed_noise)
    print(f"samples: mean {samples.mean().item():.4f} std {samples.std().item():.4f}")


if __name__ == "__main__":
    main()
