"""A CNN on scikit-learn's digits fed by a ``DataLoader`` with two worker processes.

A ``Dataset`` class with ``__len__`` / ``__getitem__`` and a random-shift augmentation; a
``DataLoader(num_workers=2, shuffle=True)`` seeded by a generator; ``nn.ReLU(inplace=True)``
and ``nn.BatchNorm2d``; a train / test split; ``model.eval()`` with ``torch.no_grad()`` for
the test accuracy after each epoch, ``model.train()`` again after it.

FIELD_FAULT=nan: the log of a negative number in the forward pass of step 7.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset

FAULT = os.environ.get("FIELD_FAULT", "")


class DigitsDataset(Dataset):
    def __init__(self, images, labels, augment=False):
        self.images = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
        self.labels = torch.tensor(labels, dtype=torch.long)
        self.augment = augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        image = self.images[idx]
        if self.augment:  # a deterministic shift, so that the run is reproducible
            image = torch.roll(image, shifts=idx % 3 - 1, dims=2)
        return image, self.labels[idx]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(64, 10)
        self.poisoned = False

    def forward(self, x):
        x = torch.flatten(self.features(x), 1)
        x = self.dropout(F.relu(self.fc1(x)))
        if self.poisoned:
            x = torch.log(x - 1.0)  # <- fault
        return F.log_softmax(self.fc2(x), dim=1)


def test(model, loader):
    model.eval()
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            total_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    n = len(loader.dataset)
    return total_loss / n, correct / n


def main():
    torch.manual_seed(1)
    digits = load_digits()
    split = 1200
    train_set = DigitsDataset(digits.images[:split], digits.target[:split], augment=True)
    test_set = DigitsDataset(digits.images[split:], digits.target[split:])
    g = torch.Generator().manual_seed(0)
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True, num_workers=2, generator=g)
    test_loader = DataLoader(test_set, batch_size=200, num_workers=2)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    for epoch in range(1, 3):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            model.poisoned = FAULT == "nan" and step == 7
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % 6 == 0:
                print(f"epoch {epoch} [{batch_idx * len(data)}/{split}] loss {loss.item():.4f}")
            step += 1
        test_loss, accuracy = test(model, test_loader)
        print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
